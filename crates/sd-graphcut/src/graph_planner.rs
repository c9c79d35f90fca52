//! [`GraphPlanner`]: planning ggml graphs with measured compute buffers and a plan cache.

use std::sync::Arc;

use sd_tensor::ggml::BufferType;

use crate::cache::{CacheStats, PlanCache};
use crate::error::Result;
use crate::plan::Plan;
use crate::planner::{plan_view, PlanOptions};
use crate::segment_graph::GallocrMeasure;
use crate::view::CapturedGraph;

/// Plans captured ggml graphs, measuring each segment's compute buffer with ggml's graph
/// allocator for one buffer type, and caches plans by graph fingerprint.
#[derive(Debug)]
pub struct GraphPlanner {
    buft: BufferType,
    options: PlanOptions,
    cache: PlanCache,
}

impl GraphPlanner {
    /// A planner measuring for `buft` (the compute backend's buffer type), caching up to
    /// `cache_capacity` plans.
    pub fn new(buft: BufferType, options: PlanOptions, cache_capacity: usize) -> GraphPlanner {
        GraphPlanner {
            buft,
            options,
            cache: PlanCache::new(cache_capacity),
        }
    }

    /// The plan for `graph`: from the cache when a plan for the same structure is cached
    /// and still validates, otherwise planned, validated and cached.
    pub fn plan(&mut self, graph: &CapturedGraph) -> Result<Arc<Plan>> {
        let _span =
            tracing::debug_span!("graph_planner", fingerprint = %graph.view().fingerprint())
                .entered();
        let (buft, options) = (self.buft, self.options);
        self.cache.get_or_plan(graph.view(), |view| {
            let mut measure = GallocrMeasure::new(graph, buft);
            let mut plan = plan_view(view, &options, &mut measure)?;
            plan.diagnostics.extend(graph.diagnostics().iter().cloned());
            Ok(plan)
        })
    }

    /// The plan cache.
    pub fn cache(&self) -> &PlanCache {
        &self.cache
    }

    /// Cache counters.
    pub fn stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// The buffer type segments are measured for.
    pub fn buffer_type(&self) -> BufferType {
        self.buft
    }
}
