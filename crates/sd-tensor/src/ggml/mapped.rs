//! Read-only buffers over host memory owned elsewhere (memory-mapped model files).
//!
//! The owner of the bytes (for example an `Arc<memmap2::Mmap>`) is kept alive by a registry
//! entry keyed by the ggml buffer until the [`Buffer`] is dropped; writes through the safe
//! layer into such a buffer are refused, since the mapping may be read-only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use ggml_sys as sys;

use super::backend::Buffer;
use super::error::Result;

/// Bytes that stay at one address while shared (a memory map, a leaked vector).
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

fn registry() -> &'static Mutex<HashMap<usize, SharedBytes>> {
    static R: OnceLock<Mutex<HashMap<usize, SharedBytes>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
}

pub(crate) fn is_read_only(buffer: sys::ggml_backend_buffer_t) -> bool {
    !buffer.is_null()
        && registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&(buffer as usize))
}

pub(crate) fn release(buffer: sys::ggml_backend_buffer_t) {
    registry()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(buffer as usize));
}

impl Buffer {
    /// A read-only CPU buffer over `bytes` without copying; `bytes` is kept alive until the
    /// buffer is dropped. Tensors are placed in it with [`Buffer::place`].
    pub fn from_shared_bytes(bytes: SharedBytes) -> Result<Buffer> {
        let slice: &[u8] = (*bytes).as_ref();
        let (ptr, len) = (slice.as_ptr() as *mut u8, slice.len());
        // SAFETY: the registry keeps `bytes` (and so ptr..ptr+len) alive and in place until
        // the buffer is released in Buffer's Drop; writes through the safe layer are refused.
        let buf = unsafe { Buffer::from_host_ptr(ptr, len)? };
        registry()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(buf.raw() as usize, bytes);
        Ok(buf)
    }
}
