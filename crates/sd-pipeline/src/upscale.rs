//! Image upscaling with an upscaler model (ESRGAN, Real-ESRGAN, Compact, MoSR; see
//! [`sd_models::upscaler`]), tiled.
//!
//! The image is cut into square tiles of `tile_size` input pixels overlapping by a quarter
//! of a tile; the last tile of a row or column is moved back to end at the image border, so
//! every tile has one size and one graph serves them all. Tile outputs are blended with
//! weights that are zero in the outer quarter of each overlap (where a tile's own zero padding
//! shows), rise linearly across the middle half and are one beyond; sides on the image border
//! keep weight one. Every output pixel is the weighted mean of the tiles covering it, so no
//! seam shows and, where a tile's receptive field fits in its margin, tiled equals untiled.
//!
//! RGBA input: the RGB channels are upscaled by the model, the alpha channel bilinearly
//! (as stable-diffusion.cpp does), and re-attached. Models whose input must be a multiple of
//! the pixel-unshuffle factor (Real-ESRGAN x2plus) get the image reflect-padded at its right
//! and bottom (spandrel's `pad_to_multiple`), and the output cropped.
//!
//! [`TileExecutor`] runs one tile. [`CpuUpscaler`] is the standalone CPU implementation
//! (weights in host memory, one allocated graph reused for every tile of a size);
//! [`RuntimeTiles`] runs the tiles through a pipeline's [`Runtime`]: the upscaler joins the
//! pipeline's residency manager as a second model source ([`UpscalerModel::add`]) and shares
//! its device and `--max-vram` budget with the diffusion models, whose idle weight copies the
//! engine reclaims when the upscaler needs the room.

use std::path::Path;

use sd_models::upscaler::{self, Upscaler, UpscalerArch};
use sd_models::HostData;
use sd_models::{load_all_to_cpu, ComputeOptions, GraphCtx, ModelError, ParamBuilder};
use sd_residency::Component;
use sd_tensor::ggml::{Backend, Buffer, GTensor, Gallocr, GgmlError, Graph};
use sd_tensor::host::{ImageError, PixelRange};
use sd_tensor::{DType, Image, Tensor};
use thiserror::Error;

use crate::runtime::{BuiltGraph, ModelHandle, Runtime, RuntimeError};

/// Descriptor and node capacity of one upscaler graph (x4plus, 23 blocks: about 30000
/// tensors).
const UPSCALE_GRAPH: usize = 65536;

/// Errors of upscaling.
#[derive(Debug, Error)]
pub enum UpscaleError {
    /// The model file could not be read or is not a supported upscaler.
    #[error("upscale model {path}: {source}")]
    Model {
        /// The model file.
        path: String,
        /// What went wrong.
        source: Box<ModelError>,
    },
    /// Building or running the graph failed.
    #[error(transparent)]
    Graph(Box<ModelError>),
    /// A ggml operation failed.
    #[error(transparent)]
    Ggml(#[from] GgmlError),
    /// An image operation failed.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The options or the input do not fit the model.
    #[error("upscale: {0}")]
    Invalid(String),
    /// An execution backend failed.
    #[error("upscale: {0}")]
    Backend(String),
    /// The pipeline runtime refused or failed.
    #[error("upscale: {0}")]
    Runtime(#[from] Box<RuntimeError>),
}

impl From<ModelError> for UpscaleError {
    fn from(e: ModelError) -> Self {
        UpscaleError::Graph(Box::new(e))
    }
}

/// Upscaling settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UpscaleOptions {
    /// Tile size in input pixels (0: the whole image at once). Rounded down to a multiple of
    /// the model's size multiple.
    pub tile_size: usize,
    /// How many times the model is applied (`--upscale-repeats`).
    pub repeats: usize,
}

impl Default for UpscaleOptions {
    /// 128-pixel tiles (stable-diffusion.cpp's ESRGAN tile size), one pass.
    fn default() -> Self {
        UpscaleOptions {
            tile_size: 128,
            repeats: 1,
        }
    }
}

/// Runs an upscaler on one tile.
pub trait TileExecutor {
    /// The model's architecture.
    fn arch(&self) -> &UpscalerArch;

    /// Upscales `planes` (`[C, H, W]` f32 in [0, 1], `C` = the model's input channels, W and
    /// H multiples of [`UpscalerArch::size_multiple`]); returns `[C_out, H * s, W * s]`.
    fn run_tile(&mut self, planes: &[f32], w: usize, h: usize) -> Result<Vec<f32>, UpscaleError>;
}

/// An allocated graph for one tile size.
struct TileGraph {
    size: (usize, usize),
    // Field order: the allocator's buffer is released before the context it plans.
    _galloc: Gallocr,
    graph: Graph,
    input: GTensor,
    output: GTensor,
    _g: GraphCtx,
}

/// A [`TileExecutor`] on the CPU backend: parameters loaded to host memory once, one graph
/// per tile size, reused.
pub struct CpuUpscaler {
    arch: UpscalerArch,
    model: Upscaler,
    backend: Backend,
    tile: Option<TileGraph>,
    opts: ComputeOptions,
    _params: Buffer,
}

impl std::fmt::Debug for CpuUpscaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuUpscaler")
            .field("arch", &self.arch)
            .finish_non_exhaustive()
    }
}

impl CpuUpscaler {
    /// Opens `path`, detects the architecture and loads the weights to host memory.
    pub fn open(path: impl AsRef<Path>, threads: usize) -> Result<Self, UpscaleError> {
        let path = path.as_ref();
        let model_err = |source| UpscaleError::Model {
            path: path.display().to_string(),
            source: Box::new(source),
        };
        let (catalog, arch) = upscaler::open(path).map_err(model_err)?;
        let pb = ParamBuilder::new(Some(&catalog), 4096).map_err(model_err)?;
        let model = Upscaler::new(&pb, &arch).map_err(model_err)?;
        let params = load_all_to_cpu(&pb.finish(), &catalog).map_err(model_err)?;
        Ok(CpuUpscaler {
            arch,
            model,
            backend: Backend::cpu(threads)?,
            tile: None,
            opts: ComputeOptions::default(),
            _params: params,
        })
    }

    /// A CPU upscaler over parameters already in host memory (`params` must hold them).
    pub fn from_parts(
        model: Upscaler,
        params: Buffer,
        threads: usize,
    ) -> Result<Self, UpscaleError> {
        Ok(CpuUpscaler {
            arch: model.arch(),
            model,
            backend: Backend::cpu(threads)?,
            tile: None,
            opts: ComputeOptions::default(),
            _params: params,
        })
    }

    /// Sets the numerical options (default: exact f32 convolutions).
    pub fn with_options(mut self, opts: ComputeOptions) -> Self {
        self.opts = opts;
        self.tile = None;
        self
    }

    fn graph_for(&mut self, w: usize, h: usize) -> Result<(), UpscaleError> {
        if self.tile.as_ref().is_none_or(|t| t.size != (w, h)) {
            self.tile = None;
            let c = self.arch.input_channels();
            let mut g = GraphCtx::new(UPSCALE_GRAPH, UPSCALE_GRAPH, self.opts)?;
            let input = g.ctx.new_tensor(DType::F32, &[w, h, c, 1])?;
            input.set_name("image");
            input.set_input();
            let output = self.model.forward(&mut g, &input)?;
            output.set_output();
            let mut graph = Graph::new(&g.ctx, UPSCALE_GRAPH)?;
            graph.build_forward_expand(&output)?;
            let mut galloc = Gallocr::new(self.backend.buffer_type())?;
            galloc.alloc_graph(&graph)?;
            for aux in &g.aux {
                aux.data.write_to(&aux.tensor)?;
            }
            self.tile = Some(TileGraph {
                size: (w, h),
                _galloc: galloc,
                graph,
                input,
                output,
                _g: g,
            });
        }
        Ok(())
    }
}

impl TileExecutor for CpuUpscaler {
    fn arch(&self) -> &UpscalerArch {
        &self.arch
    }

    fn run_tile(&mut self, planes: &[f32], w: usize, h: usize) -> Result<Vec<f32>, UpscaleError> {
        self.graph_for(w, h)?;
        let t = self.tile.as_ref().expect("graph built");
        t.input.write_f32(planes)?;
        self.backend.compute(&t.graph)?;
        Ok(t.output.read_f32()?)
    }
}

/// An upscaler added to a pipeline's [`Runtime`] (its weights registered with the runtime's
/// residency manager as a second model source, component [`Component::Upscaler`]).
#[derive(Debug)]
pub struct UpscalerModel {
    /// The model's handle in the runtime.
    pub handle: ModelHandle,
    /// The network.
    pub model: Upscaler,
    /// Its architecture.
    pub arch: UpscalerArch,
}

impl UpscalerModel {
    /// Opens `path`, detects the architecture and adds the model to `rt` (weights are read
    /// when a tile first needs them).
    pub fn add(rt: &mut Runtime, path: impl AsRef<Path>) -> Result<Self, UpscaleError> {
        let path = path.as_ref();
        let (catalog, arch) = upscaler::open(path).map_err(|source| UpscaleError::Model {
            path: path.display().to_string(),
            source: Box::new(source),
        })?;
        let source = rt.add_source(catalog).map_err(Box::new)?;
        let (handle, model) = rt
            .add_model("upscaler", Component::Upscaler, source, |pb| {
                Upscaler::new(pb, &arch)
            })
            .map_err(Box::new)?;
        Ok(UpscalerModel {
            handle,
            model,
            arch,
        })
    }
}

impl UpscalerModel {
    /// Plans one `w` x `h` tile against the runtime's budget without running it (see
    /// [`Runtime::plan`]).
    pub fn plan_tile(
        &self,
        rt: &mut Runtime,
        w: usize,
        h: usize,
    ) -> Result<sd_exec::PlanSummary, crate::runtime::RuntimeError> {
        let c = self.arch.input_channels();
        let net = &self.model;
        rt.plan(self.handle, "upscale tile", UPSCALE_GRAPH, |g| {
            let x = g.ctx.new_tensor(DType::F32, &[w, h, c, 1])?;
            x.set_name("image");
            let output = net.forward(g, &x)?;
            Ok(BuiltGraph {
                output,
                inputs: vec![(x, HostData::F32(vec![0.0; w * h * c]))],
            })
        })
    }

    /// The tile (`w`, `h`, count) [`upscale_planes`] runs for a `w` x `h` input with tiles
    /// of `tile_size` input pixels (0: untiled).
    pub fn tiles(&self, w: usize, h: usize, tile_size: usize) -> (usize, usize, usize) {
        let m = self.arch.size_multiple().max(1);
        let (pw, ph) = (w.div_ceil(m) * m, h.div_ceil(m) * m);
        let (tile, overlap) = if tile_size == 0 {
            (usize::MAX, 0)
        } else {
            let t = (tile_size / m * m).max(m);
            (t, (t / 4) / m * m)
        };
        let (tw, th) = (tile.min(pw), tile.min(ph));
        let n = tile_starts(pw, tw, overlap).len() * tile_starts(ph, th, overlap).len();
        (tw, th, n)
    }
}

/// A [`TileExecutor`] running an [`UpscalerModel`]'s tiles through its runtime.
#[derive(Debug)]
pub struct RuntimeTiles<'a> {
    /// The runtime.
    pub rt: &'a mut Runtime,
    /// The model (added to `rt`).
    pub model: &'a UpscalerModel,
}

impl TileExecutor for RuntimeTiles<'_> {
    fn arch(&self) -> &UpscalerArch {
        &self.model.arch
    }

    fn run_tile(&mut self, planes: &[f32], w: usize, h: usize) -> Result<Vec<f32>, UpscaleError> {
        let c = self.model.arch.input_channels();
        let net = &self.model.model;
        let out = self
            .rt
            .run(self.model.handle, "upscale tile", UPSCALE_GRAPH, |g| {
                let x = g.ctx.new_tensor(DType::F32, &[w, h, c, 1])?;
                x.set_name("image");
                let output = net.forward(g, &x)?;
                Ok(BuiltGraph {
                    output,
                    inputs: vec![(x, HostData::F32(planes.to_vec()))],
                })
            })
            .map_err(Box::new)?;
        Ok(out.data)
    }
}

/// Tile starts along one axis of `len` pixels for tiles of `tile` with `overlap`: one tile
/// when it fits, else a tile every `tile - overlap` and a last one ending at `len`.
pub fn tile_starts(len: usize, tile: usize, overlap: usize) -> Vec<usize> {
    if tile == 0 || len <= tile {
        return vec![0];
    }
    let stride = (tile - overlap.min(tile - 1)).max(1);
    let mut starts = Vec::new();
    let mut s = 0;
    while s + tile < len {
        starts.push(s);
        s += stride;
    }
    starts.push(len - tile);
    starts
}

/// Blending weight along one axis of a tile of `n` output pixels: zero in the outer
/// quarter of an overlap of `overlap` output pixels on each side that has a neighbour, a
/// linear ramp over the middle half, one beyond.
pub fn axis_weights(n: usize, overlap: usize, before: bool, after: bool) -> Vec<f32> {
    let margin = overlap as f32 / 4.0;
    let ramp = (overlap as f32 / 2.0).max(1.0);
    let r = |d: f32| ((d - margin) / ramp).clamp(0.0, 1.0);
    (0..n)
        .map(|o| {
            let mut w = 1.0;
            if before {
                w *= r(o as f32 + 0.5);
            }
            if after {
                w *= r((n - o) as f32 - 0.5);
            }
            w
        })
        .collect()
}

/// Reflect-pads `[C, H, W]` planes at the right and bottom to multiples of `m` (a
/// 1-pixel-wide axis repeats its pixel).
fn pad_to_multiple(x: &[f32], c: usize, h: usize, w: usize, m: usize) -> (Vec<f32>, usize, usize) {
    let (ph, pw) = (h.div_ceil(m) * m, w.div_ceil(m) * m);
    if (ph, pw) == (h, w) {
        return (x.to_vec(), h, w);
    }
    let refl = |i: usize, n: usize| {
        if i < n {
            i
        } else if n == 1 {
            0
        } else {
            // Reflection without repeating the edge; paddings are smaller than m <= 4.
            (2 * (n - 1)).saturating_sub(i).min(n - 1)
        }
    };
    let mut out = Vec::with_capacity(c * ph * pw);
    for ch in 0..c {
        for y in 0..ph {
            for xx in 0..pw {
                out.push(x[ch * h * w + refl(y, h) * w + refl(xx, w)]);
            }
        }
    }
    (out, ph, pw)
}

/// Upscales `[C, H, W]` planes (C = the model's input channels, values in [0, 1]) with
/// tiles of `tile_size` input pixels (0: untiled). Returns the `[C_out, H * s, W * s]`
/// planes, not clamped.
pub fn upscale_planes(
    exec: &mut dyn TileExecutor,
    planes: &[f32],
    w: usize,
    h: usize,
    tile_size: usize,
) -> Result<Vec<f32>, UpscaleError> {
    let arch = exec.arch().clone();
    let (c, co, s, m) = (
        arch.input_channels(),
        arch.output_channels(),
        arch.scale(),
        arch.size_multiple(),
    );
    if w == 0 || h == 0 || planes.len() != c * w * h {
        return Err(UpscaleError::Invalid(format!(
            "{} values for a {w}x{h} image of {c} channels",
            planes.len()
        )));
    }
    let _span =
        tracing::info_span!("upscale", arch = arch.id(), w, h, scale = s, tile_size).entered();
    let (x, ph, pw) = pad_to_multiple(planes, c, h, w, m);
    // Tile and overlap in input pixels, multiples of m.
    let tile = if tile_size == 0 {
        usize::MAX
    } else {
        (tile_size / m * m).max(m)
    };
    let overlap = if tile == usize::MAX {
        0
    } else {
        (tile / 4) / m * m
    };
    let (tw, th) = (tile.min(pw), tile.min(ph));
    let xs = tile_starts(pw, tw, overlap);
    let ys = tile_starts(ph, th, overlap);
    let (ow, oh) = (pw * s, ph * s);
    let mut acc = vec![0f32; co * ow * oh];
    let mut wsum = vec![0f32; ow * oh];
    let mut tile_in = vec![0f32; c * tw * th];
    let n_tiles = xs.len() * ys.len();
    for (iy, &y0) in ys.iter().enumerate() {
        let wy = axis_weights(th * s, overlap * s, iy > 0, iy + 1 < ys.len());
        for (ix, &x0) in xs.iter().enumerate() {
            tracing::debug!(
                tile = iy * xs.len() + ix + 1,
                of = n_tiles,
                x0,
                y0,
                "upscale tile"
            );
            let wx = axis_weights(tw * s, overlap * s, ix > 0, ix + 1 < xs.len());
            for ch in 0..c {
                for y in 0..th {
                    let src = ch * ph * pw + (y0 + y) * pw + x0;
                    let dst = ch * th * tw + y * tw;
                    tile_in[dst..dst + tw].copy_from_slice(&x[src..src + tw]);
                }
            }
            let out = exec.run_tile(&tile_in, tw, th)?;
            let (tow, toh) = (tw * s, th * s);
            if out.len() != co * tow * toh {
                return Err(UpscaleError::Backend(format!(
                    "tile output has {} values, expected {}",
                    out.len(),
                    co * tow * toh
                )));
            }
            for y in 0..toh {
                let gy = y0 * s + y;
                for xx in 0..tow {
                    let wgt = wy[y] * wx[xx];
                    if wgt == 0.0 {
                        continue;
                    }
                    let gx = x0 * s + xx;
                    wsum[gy * ow + gx] += wgt;
                    for ch in 0..co {
                        acc[ch * oh * ow + gy * ow + gx] +=
                            wgt * out[ch * toh * tow + y * tow + xx];
                    }
                }
            }
        }
    }
    // Normalise and crop the padding.
    let (fw, fh) = (w * s, h * s);
    let mut res = Vec::with_capacity(co * fw * fh);
    for ch in 0..co {
        for y in 0..fh {
            for xx in 0..fw {
                let i = y * ow + xx;
                res.push(acc[ch * oh * ow + i] / wsum[i]);
            }
        }
    }
    Ok(res)
}

/// Upscales an RGB or RGBA image `opts.repeats` times. Alpha is resized bilinearly to the
/// final size and re-attached.
pub fn upscale_image(
    exec: &mut dyn TileExecutor,
    image: &Image,
    opts: &UpscaleOptions,
) -> Result<Image, UpscaleError> {
    let arch = exec.arch().clone();
    if arch.input_channels() != 3 || arch.output_channels() != 3 {
        return Err(UpscaleError::Invalid(format!(
            "the {} model takes {} and gives {} channels; only RGB models are supported",
            arch.id(),
            arch.input_channels(),
            arch.output_channels()
        )));
    }
    if opts.repeats == 0 {
        return Err(UpscaleError::Invalid(
            "--upscale-repeats must be at least 1".into(),
        ));
    }
    let (mut rgb, alpha) = image.split_alpha();
    for _ in 0..opts.repeats {
        let t = rgb.to_tensor(PixelRange::ZeroToOne);
        let (w, h) = (rgb.width(), rgb.height());
        let out = upscale_planes(exec, t.data(), w, h, opts.tile_size)?;
        let s = arch.scale();
        let t = Tensor::new([1, 3, h * s, w * s], out).map_err(ImageError::Shape)?;
        rgb = Image::from_tensor(&t, PixelRange::ZeroToOne)?;
    }
    Ok(match alpha {
        None => rgb,
        Some(a) => {
            let a = a
                .interpolate_bilinear(rgb.height(), rgb.width(), false)
                .map_err(ImageError::Shape)?;
            rgb.with_alpha(&a)?
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_the_axis_and_end_at_its_border() {
        assert_eq!(tile_starts(100, 128, 32), vec![0]);
        assert_eq!(tile_starts(128, 128, 32), vec![0]);
        assert_eq!(tile_starts(72, 32, 8), vec![0, 24, 40]);
        assert_eq!(tile_starts(300, 128, 32), vec![0, 96, 172]);
        for (len, tile, ov) in [(1000, 128, 32), (129, 128, 32), (17, 4, 1), (9, 8, 0)] {
            let s = tile_starts(len, tile, ov);
            assert_eq!(s[0], 0);
            assert_eq!(*s.last().unwrap() + tile, len);
            for p in s.windows(2) {
                assert!(p[1] > p[0] && p[1] <= p[0] + tile - ov.min(tile - 1));
            }
        }
    }

    #[test]
    fn overlap_weights_sum_to_one_and_vanish_at_inner_edges() {
        // Two tiles of 16 overlapping by 8: weights across the overlap sum to one.
        let a = axis_weights(16, 8, false, true);
        let b = axis_weights(16, 8, true, false);
        for i in 0..8 {
            let s = a[8 + i] + b[i];
            assert!((s - 1.0).abs() < 1e-6, "{i}: {s}");
        }
        assert_eq!(a[15], 0.0);
        assert_eq!(a[14], 0.0);
        assert_eq!(a[0], 1.0);
        assert_eq!(b[0], 0.0);
        assert!(axis_weights(5, 0, true, true).iter().all(|&w| w > 0.0));
    }

    #[test]
    fn reflect_padding_to_a_multiple() {
        // One 3x1 plane padded to 4x2: columns 0 1 2 1, rows 0 0.
        let (p, h, w) = pad_to_multiple(&[1.0, 2.0, 3.0], 1, 1, 3, 2);
        assert_eq!((h, w), (2, 4));
        assert_eq!(p, vec![1.0, 2.0, 3.0, 2.0, 1.0, 2.0, 3.0, 2.0]);
    }
}
