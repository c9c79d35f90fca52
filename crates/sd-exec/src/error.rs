//! Errors of the execution layer.

use sd_graphcut::GraphCutError;
use sd_residency::ResidencyError;
use sd_tensor::GgmlError;
use thiserror::Error;

use crate::session::SessionId;

/// What went wrong while running a graph. Every message names the session, segment or
/// tensor and, for memory, the bytes needed and available.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ExecError {
    /// A session id this engine does not know (never created, or removed).
    #[error("unknown execution session {0}")]
    UnknownSession(SessionId),
    /// `execute` on a session that was not started (or was ended).
    #[error("execution session {0} is not started")]
    NotStarted(SessionId),
    /// The task is malformed (no such output, bad host input size...).
    #[error("invalid compute task '{task}': {detail}")]
    InvalidTask {
        /// The task's description.
        task: String,
        /// What is wrong.
        detail: String,
    },
    /// Not enough memory on the device or in the budget, even after releasing other
    /// sessions' idle workspaces and evicting every evictable weight block.
    #[error(
        "{what} does not fit on {backend}: needs {needed_device} B of device memory \
         ({available_device} B available) and {needed_budget} B of budget \
         ({available_budget} B available of a budget of {budget})",
        budget = .budget.map_or_else(|| "unlimited".to_string(), |b| format!("{b} B"))
    )]
    Capacity {
        /// What was being made room for (for example `segment 3 'mid'` or `whole graph`).
        what: String,
        /// The compute backend.
        backend: String,
        /// Bytes needed on the device.
        needed_device: u64,
        /// Bytes available on the device.
        available_device: u64,
        /// Bytes needed within the budget (the session's resident bytes included).
        needed_budget: u64,
        /// Bytes available within the budget.
        available_budget: u64,
        /// The session budget (`None`: only the device and the manager's budget apply).
        budget: Option<u64>,
    },
    /// A segment does not fit the limit even at the finest cut granularity the model
    /// marked; found while planning, before anything runs.
    #[error("{0}")]
    BudgetTooSmall(Box<BudgetShortfall>),
    /// A device allocation failed although capacity was checked (reported as such).
    #[error("allocation failed while {context}: {source}")]
    Allocation {
        /// What was being allocated.
        context: String,
        /// The ggml error.
        #[source]
        source: GgmlError,
    },
    /// Another ggml failure (compute, copy, read).
    #[error("{context}: {source}")]
    Ggml {
        /// What the engine was doing.
        context: String,
        /// The ggml error.
        #[source]
        source: GgmlError,
    },
    /// The execution panicked (a bug); the session's graph state was discarded.
    #[error("executing '{task}' panicked: {detail}")]
    Panicked {
        /// The task's description.
        task: String,
        /// The panic message.
        detail: String,
    },
    /// Planning, building or binding a segment failed.
    #[error(transparent)]
    GraphCut(#[from] GraphCutError),
    /// The residency manager refused or failed (loading, staging weights).
    #[error(transparent)]
    Residency(#[from] ResidencyError),
}

impl ExecError {
    /// Maps a ggml error: allocation failures become [`ExecError::Allocation`].
    pub(crate) fn ggml(context: impl Into<String>) -> impl FnOnce(GgmlError) -> ExecError {
        let context = context.into();
        move |source| match source {
            GgmlError::AllocationFailed { .. } => ExecError::Allocation { context, source },
            source => ExecError::Ggml { context, source },
        }
    }

    /// Whether this is an allocation or capacity failure: the engine's own, or a ggml
    /// allocation failure anywhere in its sources (the residency manager staging a weight
    /// block, the planner allocating a cut cache entry).
    pub fn is_out_of_memory(&self) -> bool {
        if matches!(
            self,
            ExecError::Capacity { .. }
                | ExecError::Allocation { .. }
                | ExecError::BudgetTooSmall(_)
        ) {
            return true;
        }
        let mut e: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(err) = e {
            if let Some(GgmlError::AllocationFailed { .. }) = err.downcast_ref::<GgmlError>() {
                return true;
            }
            e = err.source();
        }
        false
    }
}

/// What [`ExecError::BudgetTooSmall`] reports: the segment that fits the limit at no cut
/// granularity, what it needs, and the minimum budget.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetShortfall {
    /// The task's description.
    pub task: String,
    /// The compute backend.
    pub backend: String,
    /// The segment that does not fit (the largest one).
    pub segment: String,
    /// Its weight bytes.
    pub weight_bytes: u64,
    /// The compute buffer bytes (the session's workspace: the largest segment's buffer).
    pub compute_bytes: u64,
    /// The bytes of the cuts live while it runs.
    pub live_cut_bytes: u64,
    /// Its largest weight (without weights: its largest computed node).
    pub largest: String,
    /// That tensor's bytes.
    pub largest_bytes: u64,
    /// The smallest limit under which every segment found over the limit would fit.
    pub minimum: u64,
    /// The limit (tightest of session budget, manager budget and device memory).
    pub limit: u64,
    /// Bytes of the user's budget left to the backend runtime's own allocations (CUDA
    /// context, BLAS, kernels, the operator temporaries kept for it), outside `limit`; 0
    /// when not known. Set by the layer that applied the budget, so the message can name
    /// the budget to ask for.
    pub runtime_reserve: u64,
}

impl std::fmt::Display for BudgetShortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "'{}' does not fit a limit of {} B on {} at any cut granularity: segment '{}' \
             needs {} B of weights + {} B of workspace + {} B of live cuts (its largest \
             weight: '{}', {} B); minimum budget {} B",
            self.task,
            self.limit,
            self.backend,
            self.segment,
            self.weight_bytes,
            self.compute_bytes,
            self.live_cut_bytes,
            self.largest,
            self.largest_bytes,
            self.minimum
        )?;
        if self.runtime_reserve > 0 {
            let mib = |b: u64| b.div_ceil(1 << 20);
            write!(
                f,
                " (the limit is the --max-vram budget minus {} MiB left to the backend runtime \
                 itself on the device, measured at start, and its operators' temporaries: a \
                 budget of at least {} MiB is needed)",
                mib(self.runtime_reserve),
                mib(self.minimum + self.runtime_reserve)
            )?;
        }
        Ok(())
    }
}

/// Result of the execution layer.
pub type Result<T, E = ExecError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortfall_names_the_budget_to_ask_for_when_the_runtime_reserve_is_known() {
        let mut b = BudgetShortfall {
            task: "text encoder".into(),
            backend: "CUDA0".into(),
            segment: "embeddings".into(),
            weight_bytes: 76_127_232,
            compute_bytes: 2_365_440,
            live_cut_bytes: 236_544,
            largest: "token_embedding".into(),
            largest_bytes: 75_890_688,
            minimum: 78_729_216,
            limit: 29_766_451,
            runtime_reserve: 0,
        };
        assert!(!b.to_string().contains("--max-vram"));
        b.runtime_reserve = 829 << 20;
        let text = b.to_string();
        // 78,729,216 B + 829 MiB = 904.08 MiB, rounded up.
        assert!(text.contains("minus 829 MiB"), "{text}");
        assert!(text.contains("at least 905 MiB"), "{text}");
    }

    /// A weight block the residency manager could not allocate is out of memory (a caller
    /// retries smaller); a read error is not.
    #[test]
    fn allocation_failures_in_the_sources_are_out_of_memory() {
        let alloc = GgmlError::AllocationFailed {
            what: "buffer".into(),
            buffer_type: "SIM0".into(),
            bytes: 99_072,
        };
        let staging = ExecError::Residency(ResidencyError::Ggml {
            context: "allocating a staging block".into(),
            source: alloc,
        });
        assert!(staging.is_out_of_memory(), "{staging}");
        let busy = ExecError::Residency(ResidencyError::Busy("set_loras"));
        assert!(!busy.is_out_of_memory());
    }
}
