//! [`device_limit`]: the one place that combines budgets with a device's memory.

use sd_tensor::ggml::Backend;

/// The tightest of `budgets` (a session's, the manager's `--max-vram` for the device...)
/// and the total memory of `backend`'s device when it reports one; `None` when nothing
/// limits it (the CPU without a budget).
pub fn device_limit(budgets: &[Option<u64>], backend: &Backend) -> Option<u64> {
    let device_total = backend
        .device()
        .map(|d| d.memory().total)
        .filter(|t| *t > 0);
    budgets
        .iter()
        .copied()
        .chain([device_total])
        .flatten()
        .min()
}
