//! The built-in model (`models/builtin/sd-rs-shapes.safetensors`) draws what it is asked for:
//! six prompts (red / green / blue x circle / square, each on its own background), generated
//! by `txt2img` on the CPU (64x64, Euler 12 steps, CFG 5, fixed seeds), are read back from
//! their pixels: background colour, shape colour and shape must all be the prompt's.
//!
//! Pixel reading (the Rust form of `scripts/builtin_model/check.py`'s idea, with the shape
//! told by its fill ratio): every pixel snaps to the nearest colour of the training palette
//! (`scripts/builtin_model/make_dataset.py: COLOURS`); the background is the most common
//! colour on the 2-pixel border; the shape colour the most common other one; the shape is the
//! largest 4-connected region of that colour, and the fraction of its bounding box it fills
//! tells circle (pi/4 = 0.785), square (1.0) and triangle (0.5) apart.

use std::path::PathBuf;

use sd_pipeline::generate::{txt2img, Txt2Img};
use sd_pipeline::rng::RngKind;
use sd_pipeline::sampling::SampleMethod;
use sd_pipeline::schedule::Scheduler;
use sd_tensor::Image;

/// The training palette, sRGB.
const PALETTE: [(&str, [u8; 3]); 8] = [
    ("red", [220, 30, 30]),
    ("green", [30, 170, 40]),
    ("blue", [30, 60, 220]),
    ("yellow", [240, 220, 30]),
    ("white", [245, 245, 245]),
    ("black", [20, 20, 20]),
    ("purple", [140, 40, 180]),
    ("orange", [250, 140, 20]),
];

/// Shapes by the fraction of their bounding box they cover.
const FILL: [(&str, f64); 3] = [
    ("circle", std::f64::consts::FRAC_PI_4),
    ("square", 1.0),
    ("triangle", 0.5),
];

/// What the pixels of an image show.
#[derive(Debug, PartialEq)]
struct Reading {
    background: &'static str,
    colour: &'static str,
    shape: &'static str,
    /// Fill ratio of the shape's bounding box.
    fill: f64,
    /// The shape's share of the image.
    area: f64,
}

fn nearest(p: &[u8]) -> usize {
    let d = |c: &[u8; 3]| -> i32 {
        (0..3)
            .map(|i| (p[i] as i32 - c[i] as i32).pow(2))
            .sum::<i32>()
    };
    (0..PALETTE.len())
        .min_by_key(|&i| d(&PALETTE[i].1))
        .unwrap()
}

fn most_common(classes: impl Iterator<Item = usize>) -> Option<usize> {
    let mut n = [0usize; PALETTE.len()];
    let mut any = false;
    for c in classes {
        n[c] += 1;
        any = true;
    }
    any.then(|| {
        (0..n.len())
            .max_by_key(|&i| (n[i], usize::MAX - i))
            .unwrap()
    })
}

fn read(img: &Image) -> Option<Reading> {
    let (w, h) = (img.width(), img.height());
    let ch = img.channels();
    let cls: Vec<usize> = img.pixels().chunks_exact(ch).map(nearest).collect();
    let border = (0..h)
        .flat_map(|y| (0..w).map(move |x| (x, y)))
        .filter(|&(x, y)| x < 2 || y < 2 || x + 2 >= w || y + 2 >= h);
    let bg = most_common(border.map(|(x, y)| cls[y * w + x]))?;
    let fg = most_common(cls.iter().copied().filter(|&c| c != bg))?;
    // The largest 4-connected region of the shape colour.
    let mut seen = vec![false; w * h];
    let mut best: Vec<usize> = Vec::new();
    for start in 0..w * h {
        if seen[start] || cls[start] != fg {
            continue;
        }
        let mut region = vec![start];
        seen[start] = true;
        let mut i = 0;
        while i < region.len() {
            let p = region[i];
            i += 1;
            let (x, y) = (p % w, p / w);
            let mut push = |q: usize| {
                if !seen[q] && cls[q] == fg {
                    seen[q] = true;
                    region.push(q);
                }
            };
            if x > 0 {
                push(p - 1);
            }
            if x + 1 < w {
                push(p + 1);
            }
            if y > 0 {
                push(p - w);
            }
            if y + 1 < h {
                push(p + w);
            }
        }
        if region.len() > best.len() {
            best = region;
        }
    }
    let (mut x0, mut y0, mut x1, mut y1) = (w, h, 0, 0);
    for &p in &best {
        let (x, y) = (p % w, p / w);
        x0 = x0.min(x);
        y0 = y0.min(y);
        x1 = x1.max(x);
        y1 = y1.max(y);
    }
    let boxed = ((x1 + 1 - x0) * (y1 + 1 - y0)) as f64;
    let fill = best.len() as f64 / boxed;
    let shape = FILL
        .iter()
        .min_by(|a, b| (a.1 - fill).abs().total_cmp(&(b.1 - fill).abs()))
        .unwrap()
        .0;
    Some(Reading {
        background: PALETTE[bg].0,
        colour: PALETTE[fg].0,
        shape,
        fill,
        area: best.len() as f64 / (w * h) as f64,
    })
}

/// Draws a flat shape on a flat background, the way the training drawings look (no
/// anti-aliasing): the reader's own check.
fn draw(shape: &str, colour: [u8; 3], bg: [u8; 3], cx: f64, cy: f64, r: f64) -> Image {
    let (w, h) = (64, 64);
    let mut px = Vec::with_capacity(w * h * 3);
    for y in 0..h {
        for x in 0..w {
            let (dx, dy) = (x as f64 + 0.5 - cx, y as f64 + 0.5 - cy);
            let inside = match shape {
                "circle" => dx * dx + dy * dy <= r * r,
                "square" => dx.abs() <= r && dy.abs() <= r,
                _ => dy <= r && 2.0 * dx.abs() <= dy + r,
            };
            px.extend_from_slice(if inside { &colour } else { &bg });
        }
    }
    Image::from_rgb(w, h, px).unwrap()
}

#[test]
fn reader_tells_drawn_shapes_and_colours_apart() {
    for (shape, colour, bg) in [
        ("circle", 0, 4),
        ("square", 2, 3),
        ("triangle", 1, 5),
        ("circle", 7, 6),
    ] {
        for (cx, cy, r) in [(32.0, 32.0, 12.0), (24.0, 38.0, 9.0), (40.0, 30.0, 16.0)] {
            let img = draw(shape, PALETTE[colour].1, PALETTE[bg].1, cx, cy, r);
            let got = read(&img).unwrap();
            assert_eq!(
                (got.shape, got.colour, got.background),
                (shape, PALETTE[colour].0, PALETTE[bg].0),
                "{got:?}"
            );
        }
    }
    // A blank image has no shape.
    let blank = Image::filled(64, 64, &[245, 245, 245]).unwrap();
    assert!(read(&blank).is_none());
}

#[test]
fn builtin_model_draws_the_prompted_colour_and_shape() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/builtin/sd-rs-shapes.safetensors");
    let cases = [
        ("red", "circle", "white", 1),
        ("red", "square", "white", 2),
        ("green", "circle", "black", 3),
        ("green", "square", "black", 4),
        ("blue", "circle", "yellow", 5),
        ("blue", "square", "yellow", 6),
    ];
    let mut wrong = Vec::new();
    for (colour, shape, bg, seed) in cases {
        let prompt = format!("a {colour} {shape} on a {bg} background");
        let params = Txt2Img {
            prompt: prompt.clone(),
            width: 64,
            height: 64,
            steps: 12,
            cfg_scale: 5.0,
            seed,
            sampler: SampleMethod::Euler,
            scheduler: Scheduler::Discrete,
            threads: 2,
            rng: RngKind::Cpu,
            ..Txt2Img::default()
        };
        let t = std::time::Instant::now();
        let img = txt2img(&model, &params, &mut |_, _| {}).unwrap().remove(0);
        let got = read(&img);
        println!(
            "{prompt} (seed {seed}, {:.1} s): {got:?}",
            t.elapsed().as_secs_f64()
        );
        let ok = got.as_ref().is_some_and(|r| {
            (r.colour, r.shape, r.background) == (colour, shape, bg) && r.area > 0.02
        });
        if !ok {
            wrong.push(format!("{prompt}: read {got:?}"));
        }
    }
    assert!(wrong.is_empty(), "wrong images:\n{}", wrong.join("\n"));
}
