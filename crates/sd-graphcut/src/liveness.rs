//! Which cut outputs the cut cache must hold before, during and after each segment.
//!
//! For a cut `c` produced by segment `p(c)` and last read by segment `l(c)`:
//! - `consumed_k` = cuts segment `k` reads;
//! - `future_k` = `{ c : p(c) <= k < l(c) }` (held after `k`);
//! - `live_k` = `consumed_k ∪ future_k` (held while `k` runs).
//!
//! An executor prunes the cache to `live_k` before segment `k` and to `future_k` after it.

use std::collections::BTreeMap;

use crate::marks::CutName;
use crate::plan::{InputKind, Segment};
use crate::view::TensorRef;

/// Liveness of one segment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Liveness {
    pub consumed: Vec<CutName>,
    pub future: Vec<CutName>,
    pub live: Vec<CutName>,
    pub live_bytes: usize,
    pub future_bytes: usize,
}

struct CutLife {
    name: CutName,
    producer: usize,
    last_reader: Option<usize>,
    bytes: usize,
}

/// Liveness of every segment, from the segments' outputs and previous-cut inputs.
pub(crate) fn compute(segments: &[Segment]) -> Vec<Liveness> {
    // Cuts by node (node order = the order the sets are listed in).
    let mut cuts: BTreeMap<usize, CutLife> = BTreeMap::new();
    for (k, s) in segments.iter().enumerate() {
        for o in s.outputs.iter().filter(|o| o.is_cut) {
            cuts.entry(o.node).or_insert(CutLife {
                name: o.name.clone(),
                producer: k,
                last_reader: None,
                bytes: o.bytes,
            });
        }
    }
    let mut consumed: Vec<Vec<(usize, CutName)>> = vec![Vec::new(); segments.len()];
    for (k, s) in segments.iter().enumerate() {
        for i in s.inputs.iter().filter(|i| i.kind == InputKind::PreviousCut) {
            if let (TensorRef::Node(n), Some((name, _))) = (i.tensor, &i.cut) {
                consumed[k].push((n, name.clone()));
                if let Some(c) = cuts.get_mut(&n) {
                    c.last_reader = Some(c.last_reader.map_or(k, |l| l.max(k)));
                }
            }
        }
        consumed[k].sort();
        consumed[k].dedup();
    }
    let bytes_of = |n: usize| cuts.get(&n).map_or(0, |c| c.bytes);
    (0..segments.len())
        .map(|k| {
            let future: Vec<(usize, &CutLife)> = cuts
                .iter()
                .filter(|(_, c)| c.producer <= k && c.last_reader.is_some_and(|l| l > k))
                .map(|(&n, c)| (n, c))
                .collect();
            let mut live: Vec<(usize, CutName)> = consumed[k].clone();
            for (n, c) in &future {
                live.push((*n, c.name.clone()));
            }
            live.sort();
            live.dedup();
            Liveness {
                consumed: consumed[k].iter().map(|(_, c)| c.clone()).collect(),
                future_bytes: future.iter().map(|(_, c)| c.bytes).sum(),
                future: future.iter().map(|(_, c)| c.name.clone()).collect(),
                live_bytes: live.iter().map(|(n, _)| bytes_of(*n)).sum(),
                live: live.into_iter().map(|(_, c)| c).collect(),
            }
        })
        .collect()
}
