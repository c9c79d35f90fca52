//! Errors of the safe ggml layer.

use thiserror::Error;

/// An error reported by the safe ggml layer instead of a ggml abort.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum GgmlError {
    /// A context could not be created or has no room left.
    #[error("ggml context out of memory: {what} needs {needed} bytes, {available} left")]
    ContextFull {
        /// What was being created.
        what: String,
        /// Bytes it needs.
        needed: usize,
        /// Bytes left in the context.
        available: usize,
    },
    /// A graph has no room for more nodes or leafs.
    #[error("graph full: {needed} more nodes needed, capacity {capacity}")]
    GraphFull {
        /// Nodes still to add.
        needed: usize,
        /// The graph's node capacity.
        capacity: usize,
    },
    /// An operation's operands have shapes or types ggml would reject.
    #[error("{op}: {detail}")]
    InvalidOperands {
        /// The operation.
        op: &'static str,
        /// What is wrong with its operands.
        detail: String,
    },
    /// A buffer or graph allocation failed.
    #[error("allocation of {bytes} bytes failed on {buffer_type}: {what}")]
    AllocationFailed {
        /// What was being allocated.
        what: String,
        /// The buffer type asked.
        buffer_type: String,
        /// Bytes asked.
        bytes: usize,
    },
    /// A tensor's data was read or written while it has no memory.
    #[error("tensor '{name}' has no data allocated")]
    NotAllocated {
        /// The tensor's name.
        name: String,
    },
    /// A data transfer whose size or type does not match the tensor.
    #[error("tensor '{name}': {detail}")]
    DataMismatch {
        /// The tensor's name.
        name: String,
        /// What does not match.
        detail: String,
    },
    /// A graph computation returned a failure status.
    #[error("graph compute failed on {backend}: {status}")]
    ComputeFailed {
        /// The backend's name.
        backend: String,
        /// ggml's status.
        status: String,
    },
    /// No backend or device of that name or kind exists.
    #[error("no ggml backend or device '{0}'")]
    NoSuchBackend(String),
    /// A backend could not be initialised.
    #[error("ggml backend '{0}' failed to initialise")]
    BackendInit(String),
    /// A backend module (a `libggml-<name>.so` built with `GGML_BACKEND_DL`) could not be
    /// loaded.
    #[error("cannot load ggml backend module {path}: {detail}")]
    ModuleLoad {
        /// The module file.
        path: String,
        /// The loader's message.
        detail: String,
    },
    /// Tensors from different contexts or backends were mixed where ggml needs one.
    #[error("{0}")]
    Mismatch(String),
}

/// Convenience alias.
pub type Result<T> = std::result::Result<T, GgmlError>;

pub(crate) fn status_name(status: ggml_sys::ggml_status) -> String {
    // SAFETY: ggml_status_to_string returns a static string for every status.
    unsafe { std::ffi::CStr::from_ptr(ggml_sys::ggml_status_to_string(status)) }
        .to_string_lossy()
        .into_owned()
}
