//! Background weight transfers: the copies of a prefetch run on a transfer thread while
//! the caller computes the current segment.
//!
//! A prefetch allocates its staging blocks and places its tensors on the calling thread
//! (so every byte is accounted before the call returns); only the copies move to the
//! transfer thread. The manager waits for a transfer before anything can free or read
//! the buffers involved (activating or clearing the prefetch, dropping any block,
//! preparing parameters, changing LoRAs), and a [`TransferJob`] joins its thread when
//! dropped, so no copy outlives its buffers.

use std::thread::JoinHandle;

use sd_tensor::ggml::{Backend, GTensor};

use crate::residency::BlockId;

/// One copy: source (a params copy) into destination (its staging placement).
pub(crate) struct WeightCopy {
    pub src: GTensor,
    pub dst: GTensor,
    pub name: String,
}

/// A transfer in flight: the blocks it fills and the thread copying into them.
pub(crate) struct TransferJob {
    pub blocks: Vec<BlockId>,
    state: Option<State>,
}

enum State {
    Running(JoinHandle<Result<u64, String>>),
    Done(Result<u64, String>),
}

fn copy_all(copies: &[WeightCopy], coalesce: bool) -> Result<u64, String> {
    let _span = tracing::debug_span!("weight_transfer", copies = copies.len()).entered();
    let bytes = copies.iter().map(|c| c.dst.nbytes() as u64).sum();
    if coalesce {
        // Runs laid out alike in storage and staging go as one copy each.
        let pairs: Vec<(GTensor, GTensor)> = copies
            .iter()
            .map(|c| (c.src.clone(), c.dst.clone()))
            .collect();
        Backend::copy_tensors(&pairs).map_err(|e| {
            let first = copies.first().map_or("", |c| c.name.as_str());
            format!(
                "uploading `{first}` and {} more: {e}",
                copies.len().saturating_sub(1)
            )
        })?;
        return Ok(bytes);
    }
    for c in copies {
        Backend::copy_tensor(&c.src, &c.dst).map_err(|e| format!("uploading `{}`: {e}", c.name))?;
    }
    Ok(bytes)
}

impl TransferJob {
    /// Starts copying `copies` on a new thread; when no thread can be started, copies
    /// synchronously and returns a finished job.
    /// With `coalesce`, see [`Backend::copy_tensors`].
    pub fn spawn(copies: Vec<WeightCopy>, blocks: Vec<BlockId>, coalesce: bool) -> TransferJob {
        let shared = std::sync::Arc::new(copies);
        let theirs = shared.clone();
        let state = match std::thread::Builder::new()
            .name("sd-weight-transfer".into())
            .spawn(move || copy_all(&theirs, coalesce))
        {
            Ok(h) => State::Running(h),
            Err(e) => {
                tracing::debug!(error = %e, "no transfer thread: copying synchronously");
                State::Done(copy_all(&shared, coalesce))
            }
        };
        TransferJob {
            blocks,
            state: Some(state),
        }
    }

    /// Waits for the copies; returns the bytes copied or what failed.
    pub fn wait(mut self) -> Result<u64, String> {
        match self.state.take() {
            Some(State::Running(h)) => h
                .join()
                .unwrap_or_else(|_| Err("transfer thread panicked".into())),
            Some(State::Done(r)) => r,
            None => Ok(0),
        }
    }
}

impl Drop for TransferJob {
    fn drop(&mut self) {
        if let Some(State::Running(h)) = self.state.take() {
            let _ = h.join();
        }
    }
}
