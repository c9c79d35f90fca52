//! ggml's RPC backend: compute on a remote `rpc-server` (feature `rpc`).

use std::ffi::CString;

use ggml_sys as sys;

use super::backend::{Backend, DeviceMemory};
use super::error::{GgmlError, Result};

fn endpoint_c(endpoint: &str) -> Result<CString> {
    CString::new(endpoint).map_err(|_| GgmlError::NoSuchBackend(endpoint.to_string()))
}

impl Backend {
    /// A backend on device `device` of the RPC server at `endpoint` (`host:port`).
    pub fn rpc(endpoint: &str, device: u32) -> Result<Backend> {
        let c = endpoint_c(endpoint)?;
        // SAFETY: NUL-terminated endpoint; NULL when the server cannot be reached.
        let p = unsafe { sys::ggml_backend_rpc_init(c.as_ptr(), device) };
        Backend::from_raw_backend(p, &format!("RPC[{endpoint}]#{device}"))
    }
}

/// Free and total memory of a remote device.
pub fn rpc_device_memory(endpoint: &str, device: u32) -> Result<DeviceMemory> {
    let c = endpoint_c(endpoint)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: NUL-terminated endpoint, valid out pointers.
    unsafe { sys::ggml_backend_rpc_get_device_memory(c.as_ptr(), device, &mut free, &mut total) };
    Ok(DeviceMemory {
        free: free as u64,
        total: total as u64,
    })
}
