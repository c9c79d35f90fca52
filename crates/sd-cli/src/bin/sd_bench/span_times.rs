//! Host time per `tracing` span of the engine (`SD_BENCH_SPAN_TIMES=1`): where the host's
//! part of a step goes (capacity checks, prefetches, staging, uploads queued, kernels
//! queued), on machines without a profiler (the GPU machines have no `perf`).
//!
//! A `tracing_subscriber` layer keeps, per thread, the stack of entered spans; on exit it
//! adds the span's time (total, and self: less its children's) to its name's tally. Kept
//! here rather than with a crate: the profiling layers on crates.io (tracing-chrome,
//! tracing-timing) write traces or histograms per event, not the per-name totals a step's
//! JSON line wants.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::span::Id;
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// Count, total and self time of one span name.
#[derive(Clone, Copy, Debug, Default)]
pub struct Tally {
    /// Times the span was exited.
    pub count: u64,
    /// Time inside it.
    pub total: Duration,
    /// Time inside it and none of its children.
    pub own: Duration,
}

static TALLIES: Mutex<Option<HashMap<&'static str, Tally>>> = Mutex::new(None);

thread_local! {
    /// The entered spans of this thread: id, name, entered at, children's time.
    static STACK: RefCell<Vec<(Id, &'static str, Instant, Duration)>> = const { RefCell::new(Vec::new()) };
}

/// The layer (add it with a filter of the targets to time).
pub struct SpanTimes;

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for SpanTimes {
    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let name = span.metadata().name();
        STACK.with(|s| {
            s.borrow_mut()
                .push((id.clone(), name, Instant::now(), Duration::ZERO))
        });
    }

    fn on_exit(&self, id: &Id, _ctx: Context<'_, S>) {
        let now = Instant::now();
        let popped = STACK.with(|s| {
            let mut s = s.borrow_mut();
            let pos = s.iter().rposition(|(i, ..)| i == id)?;
            let (_, name, at, children) = s.remove(pos);
            let total = now - at;
            if let Some(parent) = pos.checked_sub(1).and_then(|p| s.get_mut(p)) {
                parent.3 += total;
            }
            Some((name, total, total.saturating_sub(children)))
        });
        let Some((name, total, own)) = popped else {
            return;
        };
        let mut t = TALLIES.lock().unwrap_or_else(|e| e.into_inner());
        let e = t.get_or_insert_with(HashMap::new).entry(name).or_default();
        e.count += 1;
        e.total += total;
        e.own += own;
    }
}

/// Clears the tallies (before the timed steps).
pub fn reset() {
    *TALLIES.lock().unwrap_or_else(|e| e.into_inner()) = None;
}

/// The tallies since the last [`reset`], per step of `steps`, as JSON: name -> {count,
/// total_ms, self_ms}, largest self time first (an empty object when the layer is off).
pub fn per_step_json(steps: usize) -> serde_json::Value {
    let t = TALLIES.lock().unwrap_or_else(|e| e.into_inner());
    let mut v: Vec<(&'static str, Tally)> = t
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (*k, *v)).collect())
        .unwrap_or_default();
    v.sort_by_key(|(_, t)| std::cmp::Reverse(t.own));
    let n = steps.max(1) as f64;
    let mut out = serde_json::Map::new();
    for (name, tally) in v {
        out.insert(
            name.to_string(),
            serde_json::json!({
                "count": tally.count as f64 / n,
                "total_ms": tally.total.as_secs_f64() * 1e3 / n,
                "self_ms": tally.own.as_secs_f64() * 1e3 / n,
            }),
        );
    }
    serde_json::Value::Object(out)
}
