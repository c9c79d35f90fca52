//! A small LRU cache of plans keyed by graph fingerprint.
//!
//! Sampling rebuilds the same graph shapes over and over (with classifier-free guidance
//! often two alternating shapes), so plans are kept per fingerprint and reused. Each hit is
//! validated against the graph before it is returned; a plan that does not validate is
//! dropped and planned again.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::plan::Plan;
use crate::validate::validate;
use crate::view::GraphView;

/// Counters of a [`PlanCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that had to plan.
    pub misses: u64,
    /// Cached plans that failed validation and were dropped.
    pub invalidated: u64,
    /// Plans evicted to make room.
    pub evictions: u64,
}

/// An LRU cache of plans keyed by [`Fingerprint`].
#[derive(Debug)]
pub struct PlanCache {
    capacity: usize,
    /// Most recently used first.
    entries: VecDeque<Arc<Plan>>,
    stats: CacheStats,
}

impl Default for PlanCache {
    fn default() -> Self {
        PlanCache::new(4)
    }
}

impl PlanCache {
    /// A cache holding at most `capacity` plans (at least 1).
    pub fn new(capacity: usize) -> PlanCache {
        PlanCache {
            capacity: capacity.max(1),
            entries: VecDeque::new(),
            stats: CacheStats::default(),
        }
    }

    /// The plan for `view`'s fingerprint, validated against `view`, if cached. Counts a
    /// hit, or nothing on a miss (see [`PlanCache::get_or_plan`]).
    pub fn get(&mut self, view: &GraphView) -> Option<Arc<Plan>> {
        let fp = view.fingerprint();
        let pos = self.entries.iter().position(|p| p.fingerprint == fp)?;
        let plan = self.entries.remove(pos)?;
        match validate(&plan, view) {
            Ok(()) => {
                self.entries.push_front(plan.clone());
                self.stats.hits += 1;
                Some(plan)
            }
            Err(e) => {
                tracing::warn!(fingerprint = %fp, "cached graph-cut plan rejected, planning again: {e}");
                self.stats.invalidated += 1;
                None
            }
        }
    }

    /// Whether a plan for `fingerprint` is cached (not validated, no LRU update).
    pub fn contains(&self, fingerprint: Fingerprint) -> bool {
        self.entries.iter().any(|p| p.fingerprint == fingerprint)
    }

    /// Adds a plan (replacing one with the same fingerprint), evicting the least recently
    /// used beyond capacity.
    pub fn insert(&mut self, plan: Plan) -> Arc<Plan> {
        let plan = Arc::new(plan);
        self.entries.retain(|p| p.fingerprint != plan.fingerprint);
        self.entries.push_front(plan.clone());
        while self.entries.len() > self.capacity {
            self.entries.pop_back();
            self.stats.evictions += 1;
        }
        plan
    }

    /// The cached plan for `view`, or a new one from `make` (validated, then cached).
    pub fn get_or_plan(
        &mut self,
        view: &GraphView,
        make: impl FnOnce(&GraphView) -> Result<Plan>,
    ) -> Result<Arc<Plan>> {
        if let Some(p) = self.get(view) {
            return Ok(p);
        }
        self.stats.misses += 1;
        let plan = make(view)?;
        validate(&plan, view)?;
        Ok(self.insert(plan))
    }

    /// Number of cached plans.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The capacity.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The counters.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Drops every plan (the counters stay).
    pub fn clear(&mut self) {
        self.entries.clear();
    }
}
