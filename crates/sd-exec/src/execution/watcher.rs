//! When queued segments finish on their device, for timelines of a step
//! ([`StreamingOptions::timeline`](crate::StreamingOptions::timeline)): a thread waits on
//! each segment's event in the order they were queued and notes the time each returns.
//! ggml's events have no query and no timestamps, so a waiting thread is how the host
//! learns when the device got there (within the wake-up latency of a thread, some
//! microseconds). Off by default: the thread costs nothing the engine needs.

use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use sd_tensor::ggml::Event;

enum Msg {
    /// Wait for the event of segment `.0`.
    Watch(usize, Arc<Event>),
    /// Reply with what was seen so far (every event sent before is waited for first).
    Flush(Sender<Vec<(usize, Instant)>>),
}

/// The waiting thread; joined when dropped.
pub(crate) struct DoneWatcher {
    tx: Option<Sender<Msg>>,
    handle: Option<JoinHandle<()>>,
}

impl DoneWatcher {
    /// Starts the thread (`None` if no thread can be started).
    pub(crate) fn start() -> Option<DoneWatcher> {
        let (tx, rx) = channel::<Msg>();
        let handle = std::thread::Builder::new()
            .name("sd-segment-watcher".into())
            .spawn(move || {
                let mut seen = Vec::new();
                while let Ok(m) = rx.recv() {
                    match m {
                        Msg::Watch(k, event) => {
                            event.synchronize();
                            seen.push((k, Instant::now()));
                        }
                        Msg::Flush(reply) => {
                            let _ = reply.send(std::mem::take(&mut seen));
                        }
                    }
                }
            })
            .ok()?;
        Some(DoneWatcher {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// Notes when segment `k`'s `event` completes.
    pub(crate) fn watch(&self, k: usize, event: Arc<Event>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Msg::Watch(k, event));
        }
    }

    /// The segments seen done since the last call, with when (waits for every event
    /// watched before).
    pub(crate) fn take(&self) -> Vec<(usize, Instant)> {
        let (reply, rx) = channel();
        match &self.tx {
            Some(tx) if tx.send(Msg::Flush(reply)).is_ok() => rx.recv().unwrap_or_default(),
            _ => Vec::new(),
        }
    }
}

impl Drop for DoneWatcher {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
