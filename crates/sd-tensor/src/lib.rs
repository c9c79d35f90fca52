//! `sd-tensor`: the bottom layer of sd-rs above the raw bindings.
//!
//! It owns three things:
//! - [`DType`] and [`convert`]: element types shared by every crate (f32/f16/bf16 and ggml's
//!   quantized block types) and conversion between them, quantization going through ggml.
//! - [`host`]: host tensors ([`host::Tensor`]) with the shape operations the pipeline needs, and
//!   8-bit RGB(A) images ([`host::Image`]).
//! - [`ggml`]: the safe ggml layer: RAII contexts, tensor handles, graphs, backends, devices,
//!   buffer types, buffers, the graph allocator and the backend scheduler. No raw ggml pointer
//!   leaves this crate.

pub mod convert;
pub mod dtype;
pub mod ggml;
pub mod host;

pub use dtype::DType;
pub use ggml::GgmlError;
pub use host::{Image, Tensor};
