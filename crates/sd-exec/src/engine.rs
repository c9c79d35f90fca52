//! [`ExecutionEngine`]: one per residency manager; owns every session and the
//! cross-session eviction policy.

use std::collections::BTreeMap;

use sd_residency::DeviceResidencyManager;

use crate::error::{ExecError, Result};
use crate::eviction::ReclaimEvent;
use crate::execution::Exec;
use crate::session::{ExecutionSession, SessionConfig, SessionId};
use crate::task::{ComputeResult, ComputeTask, PlanSummary};

/// stable-diffusion.cpp's planning headroom: a graph runs whole only if its weights, measured
/// workspace and this much more fit the budget.
pub const DEFAULT_PLANNING_HEADROOM: u64 = 128 << 20;

/// Engine-wide settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Extra bytes a whole-graph run must leave free (see
    /// [`DEFAULT_PLANNING_HEADROOM`]).
    pub planning_headroom: u64,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            planning_headroom: DEFAULT_PLANNING_HEADROOM,
        }
    }
}

/// Runs graphs for every session of one residency manager.
///
/// Model code creates a session per runner ([`create_session`](Self::create_session)),
/// starts it, and calls [`execute`](Self::execute) with a [`ComputeTask`]; the engine
/// decides whole vs segmented, stages weights, and makes room (releasing other sessions'
/// idle workspaces, then evicting weights) within each session's budget.
pub struct ExecutionEngine<M: DeviceResidencyManager> {
    manager: M,
    options: EngineOptions,
    sessions: BTreeMap<SessionId, ExecutionSession>,
    next_id: u64,
    log: Vec<ReclaimEvent>,
}

impl<M: DeviceResidencyManager> std::fmt::Debug for ExecutionEngine<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutionEngine")
            .field("options", &self.options)
            .field("sessions", &self.sessions)
            .finish()
    }
}

impl<M: DeviceResidencyManager> ExecutionEngine<M> {
    /// An engine over `manager`.
    pub fn new(manager: M, options: EngineOptions) -> Self {
        ExecutionEngine {
            manager,
            options,
            sessions: BTreeMap::new(),
            next_id: 1,
            log: Vec::new(),
        }
    }

    /// The residency manager.
    pub fn manager(&self) -> &M {
        &self.manager
    }

    /// The residency manager, mutably (registering weights, budgets...).
    pub fn manager_mut(&mut self) -> &mut M {
        &mut self.manager
    }

    /// The options.
    pub fn options(&self) -> &EngineOptions {
        &self.options
    }

    /// Creates a session (not started yet).
    pub fn create_session(&mut self, config: SessionConfig) -> SessionId {
        let id = SessionId(self.next_id);
        self.next_id += 1;
        tracing::debug!(session = %id, name = %config.name, "session created");
        self.sessions.insert(id, ExecutionSession::new(id, config));
        id
    }

    /// A session.
    pub fn session(&self, id: SessionId) -> Option<&ExecutionSession> {
        self.sessions.get(&id)
    }

    /// A session, mutably (to change its budget).
    pub fn session_mut(&mut self, id: SessionId) -> Option<&mut ExecutionSession> {
        self.sessions.get_mut(&id)
    }

    fn get_mut(&mut self, id: SessionId) -> Result<&mut ExecutionSession> {
        self.sessions
            .get_mut(&id)
            .ok_or(ExecError::UnknownSession(id))
    }

    /// Starts a session: registers it as a runtime owner with the manager.
    pub fn start(&mut self, id: SessionId) -> Result<()> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        if !s.started {
            self.manager.register_runtime_owner(id.owner());
            s.started = true;
        }
        Ok(())
    }

    /// Ends a session: releases its workspace and cut cache, its prefetched weights and the
    /// compute-device copies of every parameter it used (permanent assignments stay), and
    /// removes it as a runtime owner. It can be started again.
    pub fn end(&mut self, id: SessionId) -> Result<()> {
        let _span = tracing::debug_span!("end_session", session = %id).entered();
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        s.release_all();
        s.clear_runner_cache();
        s.choices.clear();
        s.kept_prepared.clear();
        s.planner = sd_graphcut::GraphPlanner::new(
            s.config.backend.buffer_type(),
            sd_graphcut::PlanOptions::default(),
            crate::session::PLAN_CACHE_PLANS,
        );
        let used: Vec<_> = s.params_used.iter().copied().collect();
        s.params_used.clear();
        s.started = false;
        self.manager.clear_prefetched_params(id.owner());
        let released = self.manager.release_compute_backend_params(&used);
        s.sync(&mut self.manager);
        self.manager.remove_runtime_owner(id.owner());
        released?;
        Ok(())
    }

    /// Ends (if started) and removes a session.
    pub fn remove_session(&mut self, id: SessionId) -> Result<()> {
        if self.get_mut(id)?.started {
            self.end(id)?;
        }
        self.sessions.remove(&id);
        Ok(())
    }

    /// Drops what the session holds for the current graph (after a failure): cut cache and
    /// workspace; its prefetched weights are cleared.
    pub fn discard_graph(&mut self, id: SessionId) -> Result<()> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        s.release_all();
        s.kept_prepared.clear();
        s.sync(&mut self.manager);
        self.manager.clear_prefetched_params(id.owner());
        Ok(())
    }

    /// Clears the session's caches (runner cache, cut cache and plan cache) and releases its
    /// workspace.
    pub fn clear_cache(&mut self, id: SessionId) -> Result<()> {
        self.discard_graph(id)?;
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        s.clear_runner_cache();
        s.sync(&mut self.manager);
        s.choices.clear();
        s.kept_prepared.clear();
        s.planner = sd_graphcut::GraphPlanner::new(
            s.config.backend.buffer_type(),
            sd_graphcut::PlanOptions::default(),
            crate::session::PLAN_CACHE_PLANS,
        );
        Ok(())
    }

    /// Stores host `bytes` (exactly `like.nbytes()`, in `like`'s type and shape) in session
    /// `id`'s runner cache under `name`, on its compute device, after making room for them
    /// within its budget like any other allocation. The entry stays until `end`,
    /// `clear_cache` or [`ExecutionEngine::cache_remove`]; tasks read it with
    /// [`ComputeTask::with_cached_input`] (a device-side copy, no upload).
    pub fn cache_store(
        &mut self,
        id: SessionId,
        name: &str,
        like: &sd_tensor::ggml::GTensor,
        bytes: &[u8],
    ) -> Result<()> {
        let key = runner_key(name)?;
        let mut session = self
            .sessions
            .remove(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        let result = (|| {
            if !session.started {
                return Err(ExecError::NotStarted(id));
            }
            let slot = &session.slots[0];
            let old = slot.runner_cache.get(&key).map_or(0, |t| t.nbytes() as u64);
            let pending = (bytes.len() as u64).saturating_sub(old);
            let request = sd_residency::BackendMemoryRequest {
                backend: slot.backend_id,
                owner: id.owner(),
                pending_bytes: pending,
                runtime_resident_bytes: slot.resident_bytes(),
                max_backend_bytes: slot.budget,
            };
            crate::eviction::ensure_capacity(
                &mut self.manager,
                &mut self.sessions,
                &crate::eviction::CapacityAsk {
                    what: format!("runner cache entry '{name}' of session {id}"),
                    backend_name: slot.backend.name().to_string(),
                    request,
                    required: &[],
                    preferred: crate::eviction::EvictionOrder::NONE,
                    protected: &[],
                    pending_unless_pooled: false,
                },
                &mut self.log,
            )?;
            session.slots[0]
                .runner_cache
                .store_bytes(&key, like, bytes)
                .map_err(ExecError::from)
        })();
        session.sync(&mut self.manager);
        self.sessions.insert(id, session);
        result
    }

    /// The runner cache entry `name` of session `id`, if any.
    pub fn cache_entry(&self, id: SessionId, name: &str) -> Option<&sd_tensor::ggml::GTensor> {
        let key = runner_key(name).ok()?;
        self.sessions.get(&id)?.slots[0].runner_cache.get(&key)
    }

    /// Drops the runner cache entry `name` of session `id`; returns whether there was one.
    pub fn cache_remove(&mut self, id: SessionId, name: &str) -> Result<bool> {
        let key = runner_key(name)?;
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        let removed = s.slots[0].runner_cache.contains(&key);
        s.slots[0].runner_cache.remove(&key);
        s.sync(&mut self.manager);
        Ok(removed)
    }

    /// Computes `task` in session `id` (see [`crate::execution`]). On failure (a panic
    /// inside the execution included) the session's graph state is discarded and the
    /// session stays usable; capacity and allocation failures are reported as such
    /// ([`ExecError::is_out_of_memory`]).
    pub fn execute(&mut self, id: SessionId, task: &ComputeTask) -> Result<ComputeResult> {
        let mut session = self
            .sessions
            .remove(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        if !session.started {
            self.sessions.insert(id, session);
            return Err(ExecError::NotStarted(id));
        }
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Exec {
                manager: &mut self.manager,
                others: &mut self.sessions,
                options: &self.options,
                log: &mut self.log,
                session: &mut session,
            }
            .run(task)
        }))
        .unwrap_or_else(|panic| {
            let detail = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            Err(ExecError::Panicked {
                task: task.description.clone(),
                detail,
            })
        });
        // The cut cache only lives for one graph; the workspace stays (idle, reclaimable).
        // A graph run whole keeps its output entries with its graph (see
        // `execution::reuses_graphs`): its next run writes them again in place; idle
        // reclamation releases them with the workspace.
        // A segmented run's entries become spares of the cut cache (within its spare limit,
        // see `CutCache::set_spare_limit`) for the next step's same cuts.
        let keep = matches!(&result, Ok(r) if crate::execution::reuses_graphs(r.segments.len(), &session.config));
        if result.is_err() {
            session.clear_cut_caches();
        } else if !keep {
            session.drop_cut_entries();
        }
        match &result {
            Ok(r) => {
                session.last_reports = r.segments.clone();
                session.executions += 1;
            }
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "execution failed");
                // A segment may still be queued (a panic while one was in flight).
                for slot in &session.slots {
                    slot.backend.synchronize();
                }
                session.release_all();
                self.manager.clear_prefetched_params(id.owner());
                // A panic between pin and unpin leaves the segment's weights pinned.
                let mut pinned = std::mem::take(&mut session.pinned_now);
                pinned.append(&mut session.pinned_in_flight);
                if let Err(u) = self.manager.unpin_params(&pinned) {
                    tracing::warn!(error = %u, "unpinning after a failed execution");
                }
            }
        }
        session.sync(&mut self.manager);
        self.sessions.insert(id, session);
        result
    }

    /// Chooses the plan `task` would run with in session `id` (whole, in segments, with
    /// cuts inside blocks where blocks do not fit) against the session's limit, without
    /// running it or holding device memory for it: the preflight of a run. A task that fits
    /// at no granularity is [`ExecError::BudgetTooSmall`] naming the minimum budget. Plans
    /// are cached, so the run that follows does not plan again.
    pub fn plan(&mut self, id: SessionId, task: &ComputeTask) -> Result<PlanSummary> {
        let mut session = self
            .sessions
            .remove(&id)
            .ok_or(ExecError::UnknownSession(id))?;
        let _span = tracing::debug_span!("plan_task", task = %task.description).entered();
        let result = {
            let mut exec = Exec {
                manager: &mut self.manager,
                others: &mut self.sessions,
                options: &self.options,
                log: &mut self.log,
                session: &mut session,
            };
            exec.choose(task).and_then(|(p, segmented)| {
                let details: Vec<_> = (0..p.plan.segments.len())
                    .map(|k| crate::refine::segment_plan(&p, k))
                    .collect();
                // The finest granularity: every mark on (the chosen plan when it has none).
                let minimum = if task.marks.is_empty() {
                    details.iter().map(|d| d.need).max().unwrap_or(0)
                } else {
                    let finest = exec.prepare_plan(task, &task.marks)?;
                    (0..finest.plan.segments.len())
                        .map(|k| crate::refine::segment_need(&finest, k))
                        .max()
                        .unwrap_or(0)
                };
                Ok(PlanSummary {
                    segmented,
                    segments: details.iter().map(|d| (d.name.clone(), d.need)).collect(),
                    limit: exec.segment_limit(),
                    fine_cuts: p.marks.iter().filter(|m| m.level > 0).count(),
                    details,
                    minimum,
                    input_bytes: task.inputs.iter().map(|(_, b)| b.len() as u64).sum(),
                    output_bytes: task.output.nbytes() as u64,
                })
            })
        };
        self.sessions.insert(id, session);
        result
    }

    /// Every reclamation step taken so far, in order.
    pub fn reclaim_log(&self) -> &[ReclaimEvent] {
        &self.log
    }

    /// Takes the reclamation log, leaving it empty.
    pub fn take_reclaim_log(&mut self) -> Vec<ReclaimEvent> {
        std::mem::take(&mut self.log)
    }
}

/// The cut-cache key of runner cache entry `name`.
pub(crate) fn runner_key(name: &str) -> Result<sd_graphcut::CutName> {
    sd_graphcut::CutName::new("runner", name).map_err(|reason| ExecError::InvalidTask {
        task: format!("runner cache entry '{name}'"),
        detail: reason,
    })
}
