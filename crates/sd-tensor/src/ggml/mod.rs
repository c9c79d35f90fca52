//! The safe ggml layer.
//!
//! Every raw ggml pointer lives behind one of these types:
//! - [`Context`]: a ggml context (RAII, shared by cheap clones); its tensors are [`GTensor`]
//!   handles that keep the context alive, and its operations check shapes before calling
//!   ggml, so a bad graph is a [`GgmlError`] instead of a ggml abort.
//! - [`Graph`]: a compute graph built in a context, with exact node/leaf accounting so that
//!   it never overflows.
//! - [`Backend`], [`Device`], [`BufferType`], [`Buffer`]: compute backends, the device list
//!   with free/total memory, buffer types and RAII device buffers.
//! - [`Gallocr`] and [`Scheduler`]: ggml's graph allocator and backend scheduler.
//! - [`Event`] and [`CopyStream`]: backend events, and uploads queued on a second backend
//!   of a device so that they overlap compute.
//!
//! Memory safety of tensor data: a tensor's `buffer`/`data` fields are reset to null when the
//! [`Buffer`], [`Gallocr`] or [`Scheduler`] that allocated them lets go of the memory, so a
//! later read is a [`GgmlError::NotAllocated`] instead of a dangling access.

mod alloc;
mod backend;
mod context;
mod error;
mod flops;
mod graph;
pub mod graph_ext;
#[cfg(target_arch = "x86_64")]
mod host_amx;
mod host_attention;
#[cfg(target_arch = "x86_64")]
mod host_attention_bf16;
mod host_conv;
mod host_conv_cwh;
mod host_conv_implicit;
mod host_geglu;
mod host_gelu_tanh;
mod host_group_norm;
mod host_io;
mod host_linear;
mod mapped;
pub mod modules;
mod ops;
#[cfg(feature = "rpc")]
mod rpc;
mod sched;
mod simdev;
mod stream;
mod tensor;

pub use alloc::Gallocr;
pub use backend::{Backend, Buffer, BufferType, BufferUsage, Device, DeviceKind, DeviceMemory};
pub use context::Context;
pub use error::GgmlError;
pub use flops::node_flops;
pub use graph::Graph;
pub use mapped::SharedBytes;
pub use modules::{load_backend_modules, ModuleOutcome, MODULES_ENV};
pub use ops::{
    Interpolation, Precision, ATTENTION_HOST_NAME, GEGLU_HOST_NAME, GELU_TANH_HOST_NAME,
    GROUP_NORM_HOST_NAME, IM2COL_CONV_NAME, IMPLICIT_CONV_NAME, LINEAR_HOST_NAME, TILE_CONV_NAME,
};
#[cfg(feature = "rpc")]
pub use rpc::rpc_device_memory;
pub use sched::{EvalCallback, Scheduler};
pub use simdev::{SimDevice, SimOptions, SimStats};
pub use stream::{CopyStream, Event};
pub use tensor::{GTensor, TensorId};

/// Maximum number of dimensions of a ggml tensor.
pub const MAX_DIMS: usize = ggml_sys::GGML_MAX_DIMS as usize;

/// Whether this crate's CPU kernels multiply bf16 weights (`sd --type bf16`) on AMX tiles:
/// the CPU has AMX-BF16 and the OS lets this process use it (`SD_AMX=0` turns them off).
pub fn cpu_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        host_amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The ggml version string (for example `0.26.0`).
pub fn version() -> String {
    // SAFETY: returns a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(ggml_sys::ggml_version()) }
        .to_string_lossy()
        .into_owned()
}
