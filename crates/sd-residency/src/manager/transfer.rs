//! Background weight transfers: the copies of a prefetch run while the caller computes the
//! current segment, queued on the device's copy stream or, on backends without one, on a
//! transfer thread.
//!
//! A prefetch allocates its staging blocks and places its tensors on the calling thread
//! (so every byte is accounted before the call returns); only the copies are deferred.
//!
//! **Copy stream** ([`TransferJob::queue`]; backends with queued copies and events, see
//! [`CopyStream`]): the copies wait in the device's queues for the compute queued so far
//! (the last reader of any pool region freed for them), are queued on the copy stream,
//! and an event is recorded after them. Activating the prefetch makes the compute backend
//! wait on that event ([`TransferJob::order_before`]: the next segment's compute waits for
//! its weights in the device's queue, the host does not); the host waits for it only
//! before computing ([`TransferJob::wait`], timed by the caller as the upload wait) or
//! before freeing or reusing the memory involved.
//!
//! **Transfer thread** ([`TransferJob::spawn`]): synchronous copies on a thread of their
//! own, joined when the prefetch is activated. Prefetches for several segments ahead each
//! get a thread; each starts copying when the one before it is done ([`Completion`]), so
//! the copies run in the order the segments need them, as on a copy stream, instead of
//! sharing the link.
//!
//! The manager waits for a transfer before anything can free or read the buffers involved
//! (activating or clearing the prefetch, dropping a block it fills or any params copy,
//! preparing other parameters, changing or applying LoRAs), and a [`TransferJob`] waits
//! for its copies when dropped, so no copy outlives its buffers.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use sd_tensor::ggml::{Backend, CopyStream, Event, GTensor};

use crate::residency::BlockId;

/// Set when a transfer thread has finished its copies (or failed, or panicked): the next
/// thread job waits on it before copying.
#[derive(Clone, Default)]
pub(crate) struct Completion(Arc<(Mutex<bool>, Condvar)>);

impl Completion {
    fn set(&self) {
        let (done, cv) = &*self.0;
        *done.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }

    fn wait(&self) {
        let (done, cv) = &*self.0;
        let mut d = done.lock().unwrap_or_else(|e| e.into_inner());
        while !*d {
            d = cv.wait(d).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Sets its completion when dropped: also when the copies panic.
struct SetOnDrop(Completion);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}

/// When one transfer thread job ran: `queued` when the prefetch issued it, `started` when
/// it began copying (after the job before it), `finished` when its copies were done (see
/// [`ModelManager::set_upload_log`](crate::ModelManager::set_upload_log)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UploadSpan {
    /// Bytes copied.
    pub bytes: u64,
    /// When the job was handed to its thread.
    pub queued: Instant,
    /// When its copies began.
    pub started: Instant,
    /// When its copies were done.
    pub finished: Instant,
}

/// Where transfer threads record their [`UploadSpan`]s.
pub(crate) type UploadLog = Arc<Mutex<Vec<UploadSpan>>>;

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
    /// A thread job's completion (what the next thread job waits for).
    done: Option<Completion>,
}

enum State {
    Running(JoinHandle<Result<u64, String>>),
    /// Queued on a copy stream; done when `event` is. `ordered`: the compute backend
    /// already waits on it.
    Queued {
        event: Event,
        compute: Arc<Backend>,
        bytes: u64,
        ordered: bool,
    },
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
    /// Starts copying `copies` on a new thread, once `after` (the previous thread job) is
    /// done; when no thread can be started, waits for `after`, copies synchronously and
    /// returns a finished job. With `coalesce`, see [`Backend::copy_tensors`]. With `log`,
    /// the job's [`UploadSpan`] is recorded there.
    pub fn spawn(
        copies: Vec<WeightCopy>,
        blocks: Vec<BlockId>,
        coalesce: bool,
        after: Option<Completion>,
        log: Option<UploadLog>,
    ) -> TransferJob {
        let shared = Arc::new(copies);
        let theirs = shared.clone();
        let done = Completion::default();
        let guard = SetOnDrop(done.clone());
        let before = after.clone();
        let queued = Instant::now();
        let state = match std::thread::Builder::new()
            .name("sd-weight-transfer".into())
            .spawn(move || {
                let _done = guard;
                if let Some(a) = before {
                    a.wait();
                }
                let started = Instant::now();
                let r = copy_all(&theirs, coalesce);
                if let (Some(log), Ok(bytes)) = (log, &r) {
                    let span = UploadSpan {
                        bytes: *bytes,
                        queued,
                        started,
                        finished: Instant::now(),
                    };
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(span);
                }
                r
            }) {
            Ok(h) => State::Running(h),
            Err(e) => {
                // The closure (and its guard) was dropped: `done` is set.
                tracing::debug!(error = %e, "no transfer thread: copying synchronously");
                if let Some(a) = after {
                    a.wait();
                }
                State::Done(copy_all(&shared, coalesce))
            }
        };
        TransferJob {
            blocks,
            state: Some(state),
            done: Some(done),
        }
    }

    /// A thread job's completion, for the next thread job to wait on.
    pub fn completion(&self) -> Option<Completion> {
        match self.state {
            Some(State::Running(_)) => self.done.clone(),
            _ => None,
        }
    }

    /// Queues `copies` on `stream` (with `after_compute`, after the work queued on
    /// `compute` so far: the caller may have freed memory a queued compute still reads),
    /// and records an event after them; a failure to queue is a finished job with the
    /// error. With `coalesce`, see [`Backend::copy_tensors`].
    pub fn queue(
        stream: &CopyStream,
        compute: Arc<Backend>,
        copies: Vec<WeightCopy>,
        blocks: Vec<BlockId>,
        coalesce: bool,
        after_compute: bool,
    ) -> TransferJob {
        let _span = tracing::debug_span!("weight_upload_queued", copies = copies.len()).entered();
        let bytes = copies.iter().map(|c| c.dst.nbytes() as u64).sum();
        let pairs: Vec<(GTensor, GTensor)> = copies
            .iter()
            .map(|c| (c.src.clone(), c.dst.clone()))
            .collect();
        let ordered = if after_compute {
            stream.after(&compute)
        } else {
            Ok(())
        };
        let queued = ordered.and_then(|()| {
            // SAFETY: the sources are params copies and the destinations staging
            // placements of `blocks`; the manager waits for this job (its event) before
            // freeing any params copy or any of `blocks`, before reading or writing them
            // (LoRAs), and before computing with them (`order_before` makes the compute
            // backend wait on the event first), and the job waits for the event when
            // dropped.
            unsafe { stream.upload(&pairs, coalesce) }?;
            stream.record()
        });
        let state = match queued {
            Ok(event) => State::Queued {
                event,
                compute,
                bytes,
                ordered: false,
            },
            Err(e) => {
                // What was queued before the error finishes before the blocks go.
                stream.backend().synchronize();
                let first = copies.first().map_or("", |c| c.name.as_str());
                State::Done(Err(format!(
                    "queueing the upload of `{first}` and {} more: {e}",
                    copies.len().saturating_sub(1)
                )))
            }
        };
        TransferJob {
            blocks,
            state: Some(state),
            done: None,
        }
    }

    /// Whether the job is queued on a copy stream with the compute backend already
    /// waiting on it ([`order_before`](Self::order_before)).
    pub fn is_ordered(&self) -> bool {
        matches!(self.state, Some(State::Queued { ordered: true, .. }))
    }

    /// Makes the compute backend wait for the queued copies before its later work (in the
    /// device's queue); `false` when it cannot (a thread job, or the wait failed): the
    /// caller then waits on the host.
    pub fn order_before(&mut self) -> bool {
        match &mut self.state {
            Some(State::Queued {
                event,
                compute,
                ordered,
                ..
            }) => {
                if !*ordered {
                    match compute.wait_event(event) {
                        Ok(()) => *ordered = true,
                        Err(e) => {
                            tracing::debug!(error = %e, "the compute backend cannot wait on the upload");
                            return false;
                        }
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Waits for the copies; returns the bytes copied or what failed.
    pub fn wait(mut self) -> Result<u64, String> {
        match self.state.take() {
            Some(State::Running(h)) => h
                .join()
                .unwrap_or_else(|_| Err("transfer thread panicked".into())),
            Some(State::Queued { event, bytes, .. }) => {
                event.synchronize();
                Ok(bytes)
            }
            Some(State::Done(r)) => r,
            None => Ok(0),
        }
    }
}

impl Drop for TransferJob {
    fn drop(&mut self) {
        match self.state.take() {
            Some(State::Running(h)) => {
                let _ = h.join();
            }
            Some(State::Queued { event, .. }) => event.synchronize(),
            _ => {}
        }
    }
}
