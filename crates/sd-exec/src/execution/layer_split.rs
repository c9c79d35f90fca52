//! Layer split: the plan's segments assigned to the session's devices in contiguous ranges
//! within each device's capacity.

use super::*;

impl<M: DeviceResidencyManager> Exec<'_, M> {
    /// Layer split: assigns each segment to a device, in contiguous ranges in slot order.
    /// Walking the segments with a current device, a segment moves to the next device
    /// while its new weights plus the device's workspace would overflow the current one's
    /// capacity (budget, or device memory); the last device takes what is left and streams
    /// its weights if they exceed it. Assignments are sticky per parameter: the first graph
    /// decides, and the manager is told each parameter's compute backend.
    pub(super) fn assign_layer_split(
        &mut self,
        task: &ComputeTask,
        p: &mut Prepared,
    ) -> Result<()> {
        let n = self.session.slots.len();
        let caps: Vec<u64> = self
            .session
            .slots
            .iter()
            .map(|s| crate::limit::device_limit(&[s.budget], &s.backend).unwrap_or(u64::MAX))
            .collect();
        let mut used = vec![0u64; n];
        let mut workspace = vec![0u64; n];
        let mut d = 0usize;
        let mut fresh: Vec<Vec<ParamId>> = vec![Vec::new(); n];
        for (k, seg) in p.plan.segments.iter().enumerate() {
            let params = &p.segment_params[k];
            if let Some(f) = params
                .iter()
                .filter_map(|x| self.session.split_assignment.get(x))
                .max()
            {
                d = d.max(*f);
            }
            let new_bytes: u64 = params
                .iter()
                .filter(|x| !self.session.split_assignment.contains_key(x))
                .map(|x| p.param_bytes[x])
                .sum();
            let seg_ws = (seg.bytes.compute_buffer + seg.bytes.live_cuts) as u64;
            while d + 1 < n && used[d] + new_bytes + workspace[d].max(seg_ws) > caps[d] {
                d += 1;
            }
            used[d] += new_bytes;
            workspace[d] = workspace[d].max(seg_ws);
            p.segment_device[k] = d;
            for x in params {
                match self.session.split_assignment.get(x) {
                    None => {
                        self.session.split_assignment.insert(*x, d);
                        fresh[d].push(*x);
                    }
                    Some(e) if *e != d => {
                        return Err(self.invalid(
                            task,
                            format!(
                                "layer split: parameter {x:?} is used by segments on devices {e} and {d}; \
                                 a parameter must live on one device \
                                 (mark the computation sharing it as a graph cut)"
                            ),
                        ));
                    }
                    Some(_) => {}
                }
            }
        }
        for (dev, ids) in fresh.iter().enumerate() {
            if !ids.is_empty() {
                let backend = self.session.slots[dev].backend_id;
                self.manager.assign_compute_backend(ids, backend)?;
                tracing::debug!(
                    device = dev,
                    params = ids.len(),
                    bytes = used[dev],
                    "layer split assignment"
                );
            }
        }
        Ok(())
    }
}
