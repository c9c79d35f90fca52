//! Constant inputs kept on the compute device between runs of one model: the runner cache
//! of stable-diffusion.cpp's Qwen-Image runner (its prefix cache), made general.
//!
//! A model marks inputs whose data stays the same across the runs of a phase
//! ([`sd_models::AuxInput::constant`]: RoPE tables, a prompt's text embedding). When the
//! runtime keeps constants for a model ([`crate::runtime::Runtime::keep_constants`]), each
//! such input is stored once in the model session's runner cache
//! ([`sd_exec::ExecutionEngine::cache_store`], within the budget like any other allocation)
//! and later runs read it by a device-side copy instead of an upload. An entry is keyed by
//! the input's name and shape and reused only while the bytes are equal (compared on the
//! host), so a stale entry is never read.
//!
//! The cache is an optimisation and never the reason a run fails. As the seed's fix for the
//! Qwen-Image prefix cache does: when storing an entry fails, the input goes up from the host;
//! when a run that reads entries fails for lack of memory, every entry of the model is
//! released, keeping constants is switched off for that model, and the run is retried with
//! host inputs, which gives the same bits.

use std::collections::HashMap;

use sd_exec::{ComputeTask, ExecError, ExecutionEngine, SessionId};
use sd_residency::ModelManager;
use sd_tensor::ggml::GTensor;

/// A constant input of a task, not yet fed to it.
#[derive(Clone, Debug)]
pub(crate) struct Constant {
    /// The input leaf.
    pub tensor: GTensor,
    /// Its data, `tensor.nbytes()` bytes.
    pub bytes: Vec<u8>,
}

impl Constant {
    /// The runner cache entry of this input: its name and shape.
    fn key(&self) -> String {
        let ne = self.tensor.ne().map(|n| n.to_string()).join("x");
        format!("{}.{ne}", self.tensor.name())
    }
}

/// What the runtime keeps of one model's constant inputs.
#[derive(Debug, Default)]
pub(crate) struct RunnerCache {
    /// Whether constants are kept ([`crate::runtime::Runtime::keep_constants`]).
    enabled: bool,
    /// Why keeping them was switched off after a failure, if it was.
    disabled: Option<String>,
    /// Entry name to the bytes the device copy holds.
    held: HashMap<String, Vec<u8>>,
}

impl RunnerCache {
    /// Turns keeping constants on or off (off releases the entries). After a failure
    /// switched it off, turning it on again is ignored.
    pub fn set_enabled(
        &mut self,
        engine: &mut ExecutionEngine<ModelManager>,
        session: SessionId,
        on: bool,
    ) -> Result<(), ExecError> {
        if !on {
            self.release(engine, session)?;
        }
        self.enabled = on;
        Ok(())
    }

    /// Whether constants are kept now.
    pub fn active(&self) -> bool {
        self.enabled && self.disabled.is_none()
    }

    /// Entries held on the device.
    pub fn entries(&self) -> usize {
        self.held.len()
    }

    /// Why keeping constants was switched off after a failure, if it was.
    pub fn disabled(&self) -> Option<&str> {
        self.disabled.as_deref()
    }

    /// Forgets the entries (the session ended, which released them on the device).
    pub fn forget(&mut self) {
        self.held.clear();
    }

    /// Feeds `constants` to `task` (which reads no other cache entry): from the runner cache
    /// (stored first when the cache does not hold these bytes yet) while keeping constants is
    /// on, from the host otherwise or when storing fails. Returns the constants fed from the
    /// cache, for [`RunnerCache::fall_back`].
    pub fn feed(
        &mut self,
        engine: &mut ExecutionEngine<ModelManager>,
        session: SessionId,
        task: &mut ComputeTask,
        constants: Vec<Constant>,
    ) -> Vec<Constant> {
        let mut fed = Vec::new();
        for c in constants {
            if !self.active() {
                task.inputs.push((c.tensor, c.bytes));
                continue;
            }
            let key = c.key();
            let same = self.held.get(&key).is_some_and(|b| *b == c.bytes);
            if !same {
                self.held.remove(&key);
                if let Err(e) = engine.cache_store(session, &key, &c.tensor, &c.bytes) {
                    tracing::warn!(
                        entry = %key,
                        "keeping a constant input on the device failed, uploading it at each \
                         run from now on: {e}"
                    );
                    self.disabled = Some(format!("storing '{key}': {e}"));
                    let _ = self.release(engine, session);
                    // What this task was to read from the cache goes up from the host.
                    task.cached_inputs.clear();
                    task.inputs
                        .extend(fed.drain(..).map(|c: Constant| (c.tensor, c.bytes)));
                    task.inputs.push((c.tensor, c.bytes));
                    continue;
                }
                self.held.insert(key.clone(), c.bytes.clone());
            }
            task.cached_inputs.push((c.tensor.clone(), key));
            fed.push(c);
        }
        fed
    }

    /// After `task` failed for lack of memory while reading the constants `fed` from the
    /// cache: releases every entry, switches keeping constants off and moves the inputs to
    /// the host, so that the task can run again.
    pub fn fall_back(
        &mut self,
        engine: &mut ExecutionEngine<ModelManager>,
        session: SessionId,
        task: &mut ComputeTask,
        fed: Vec<Constant>,
        error: &ExecError,
    ) -> Result<(), ExecError> {
        tracing::warn!(
            task = %task.description,
            "a run reading constant inputs from the device ran out of memory; releasing them \
             and running again with host inputs: {error}"
        );
        self.disabled = Some(format!("'{}' ran out of memory: {error}", task.description));
        self.release(engine, session)?;
        task.cached_inputs.clear();
        task.inputs
            .extend(fed.into_iter().map(|c| (c.tensor, c.bytes)));
        Ok(())
    }

    /// Drops every entry from the device.
    fn release(
        &mut self,
        engine: &mut ExecutionEngine<ModelManager>,
        session: SessionId,
    ) -> Result<(), ExecError> {
        for key in std::mem::take(&mut self.held).into_keys() {
            engine.cache_remove(session, &key)?;
        }
        Ok(())
    }
}
