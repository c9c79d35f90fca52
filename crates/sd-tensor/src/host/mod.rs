//! Host tensors and 8-bit images.
//!
//! - [`Tensor`]: an owned row-major tensor (shape outermost first) over an [`Element`] type,
//!   with shape operations, torch-compatible interpolation and f32 arithmetic.
//! - [`Image`]: an 8-bit RGB or RGBA image with tensor conversion and PNG I/O.

mod element;
mod image;
mod interpolate;
mod ops;
mod png_io;
mod shape;
mod tensor;

pub use element::Element;
pub use image::{Image, ImageError, PixelRange};
pub use interpolate::ResampleFilter;
pub use shape::{broadcast_shapes, checked_numel, contiguous_strides, ShapeError};
pub use tensor::Tensor;
