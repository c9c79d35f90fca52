//! Reference tensors of the generation fixtures and image comparison against them.

use std::path::Path;

use sd_tensor::host::PixelRange;

/// Tensor `name` of the safetensors file `file`, as f32.
pub fn tensor(file: &Path, name: &str) -> Vec<f32> {
    let mut cat = sd_formats::files::TensorCatalog::new();
    cat.add_file(file, None).unwrap();
    cat.read_converted(name, sd_tensor::DType::F32)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The largest difference in levels between `img` (interleaved RGB) and the reference
/// image `want` (planar `[3, H, W]` in [-1, 1]).
pub fn max_level_diff(img: &sd_tensor::Image, want: &[f32]) -> i32 {
    let (h, w) = (img.height(), img.width());
    let mut max = 0i32;
    for c in 0..3 {
        for i in 0..h * w {
            let ours = img.pixels()[i * 3 + c] as i32;
            let theirs = PixelRange::MinusOneToOne.to_pixel(want[c * h * w + i]) as i32;
            max = max.max((ours - theirs).abs());
        }
    }
    max
}
