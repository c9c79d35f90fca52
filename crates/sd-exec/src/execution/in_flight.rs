//! Segments queued on their devices and not waited for yet (asynchronous compute): the
//! queue of [`InFlight`] segments and waiting for them (`settle_*`), and finishing one that
//! is done (its dead cut-cache entries dropped, its weights unpinned).

use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// Waits for every segment in flight (all the work queued on their devices) and
    /// [`finish`](Self::finish)es them.
    pub(super) fn settle_all(
        &mut self,
        q: &mut VecDeque<InFlight>,
        timing: &mut ExecTiming,
    ) -> Result<()> {
        if q.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let devices: BTreeSet<usize> = q.iter().map(|f| f.device).collect();
        for d in devices {
            self.session.slots[d].backend.synchronize();
        }
        timing.compute_wait += t.elapsed();
        let mut first = Ok(());
        while let Some(f) = q.pop_front() {
            let r = self.finish(f, q.is_empty());
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// Waits for the oldest segment in flight (its event; the segments queued after it
    /// go on computing) and [`finish`](Self::finish)es it. With `more_queued`, a segment
    /// not in `q` is queued after it (nothing is freed under it).
    pub(super) fn settle_oldest(
        &mut self,
        q: &mut VecDeque<InFlight>,
        more_queued: bool,
        timing: &mut ExecTiming,
    ) -> Result<()> {
        let Some(f) = q.pop_front() else {
            return Ok(());
        };
        let t = Instant::now();
        let _span = tracing::debug_span!("segment_wait").entered();
        match &f.done {
            Some(event) => event.synchronize(),
            None => self.session.slots[f.device].backend.synchronize(),
        }
        timing.compute_wait += t.elapsed();
        self.finish(f, q.is_empty() && !more_queued)
    }

    /// Finishes a segment that is done: drops the cut entries nothing after it reads and
    /// unpins its weights (the oldest of `ExecutionSession::pinned_in_flight`). With
    /// `last` (nothing queued after it), the cut caches free what they held meanwhile and
    /// the copies the device's compute waited for are collected.
    pub(super) fn finish(&mut self, f: InFlight, last: bool) -> Result<()> {
        tracing::trace!(segment = f.index, "segment done");
        for slot in &mut self.session.slots {
            slot.cut_cache.retain(|n| !f.dead.contains(n));
            if last {
                slot.cut_cache.hold_frees(false);
            }
        }
        if last {
            // Every copy a queued segment waited for is done: collecting them waits for
            // nothing.
            self.manager.wait_for_uploads();
        }
        self.session.sync(self.manager);
        let n = f.pins.min(self.session.pinned_in_flight.len());
        let pinned: Vec<ParamId> = self.session.pinned_in_flight.drain(..n).collect();
        self.manager.unpin_params(&pinned)?;
        Ok(())
    }

    /// [`settle_all`](Self::settle_all)s the segments in flight, if any.
    pub(super) fn settle_in_flight(
        &mut self,
        in_flight: &mut Option<&mut VecDeque<InFlight>>,
        timing: &mut ExecTiming,
    ) -> Result<()> {
        match in_flight.as_deref_mut() {
            Some(q) => self.settle_all(q, timing),
            None => Ok(()),
        }
    }
}

/// A segment queued on its device and not waited for yet (see
/// [`StreamingOptions::async_compute`](crate::StreamingOptions::async_compute)). Its weights are pinned
/// (`ExecutionSession::pinned_in_flight`) until it is done.
pub(crate) struct InFlight {
    pub(super) index: usize,
    pub(super) device: usize,
    /// The cut-cache entries to drop once it is done: those it reads that nothing after
    /// it reads (kept meanwhile, since it reads them).
    pub(super) dead: Vec<CutName>,
    /// How many of `ExecutionSession::pinned_in_flight` (from the front) are its pins.
    pub(super) pins: usize,
    /// Recorded on its backend right after it: done when it is (`None`: the backend is
    /// synchronised instead).
    pub(super) done: Option<Arc<Event>>,
}
