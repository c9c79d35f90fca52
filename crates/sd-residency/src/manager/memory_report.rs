//! Device memory reports reused while nothing the manager tracks on the device changed.
//!
//! Every capacity check needs the device's free memory, and a budgeted step asks hundreds of
//! times (several checks a segment: room for it, for each prefetch, for each eviction). On
//! CUDA one report (`cudaMemGetInfo`) cost 5 µs idle and 56 µs with kernels queued on an
//! H100 (`sd-bench copy-bw`, docs/benchmarks.md). A report is reused while the weight and
//! runtime bytes the manager tracks on the device are those it was taken with (memory this
//! process allocated or freed since would change them) and it is younger than
//! [`MAX_REPORT_AGE`] (bounding how long a change by another process goes unseen).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use sd_tensor::ggml::{Device, DeviceMemory};

/// The longest a device memory report is reused.
pub(crate) const MAX_REPORT_AGE: Duration = Duration::from_millis(100);

/// One device's last report.
#[derive(Clone, Copy, Debug)]
struct Report {
    device: Device,
    /// The tracked (weight, runtime) bytes on the device when it was taken.
    tracked: (u64, u64),
    at: Instant,
    memory: DeviceMemory,
}

/// The devices' last memory reports (see the module documentation).
#[derive(Debug, Default)]
pub(crate) struct MemoryReports {
    /// Off: every check asks the device.
    pub(crate) off: bool,
    last: Mutex<Vec<Report>>,
}

impl MemoryReports {
    /// `device`'s memory: the last report if it was taken with the same `tracked` bytes
    /// less than [`MAX_REPORT_AGE`] ago, else a new one.
    pub(crate) fn memory(&self, device: &Device, tracked: (u64, u64)) -> DeviceMemory {
        if self.off {
            return device.memory();
        }
        let now = Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = last.iter().find(|r| r.device == *device) {
            if r.tracked == tracked && now.duration_since(r.at) < MAX_REPORT_AGE {
                return r.memory;
            }
        }
        let memory = device.memory();
        let report = Report {
            device: *device,
            tracked,
            at: now,
            memory,
        };
        match last.iter_mut().find(|r| r.device == *device) {
            Some(r) => *r = report,
            None => last.push(report),
        }
        memory
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_reused_only_with_the_same_tracked_bytes() {
        let cpu = Device::all()
            .into_iter()
            .next()
            .expect("ggml has a CPU device");
        let reports = MemoryReports::default();
        let first = reports.memory(&cpu, (1, 2));
        // Same tracked bytes: the stored report, even if the device's numbers moved.
        {
            let mut last = reports.last.lock().unwrap();
            last[0].memory.free = 7;
        }
        assert_eq!(reports.memory(&cpu, (1, 2)).free, 7);
        // Other tracked bytes: a new report.
        assert_eq!(reports.memory(&cpu, (1, 3)).total, first.total);
        assert_ne!(reports.memory(&cpu, (1, 3)).free, 7);
        // Too old: a new report.
        {
            let mut last = reports.last.lock().unwrap();
            last[0].at = last[0].at.checked_sub(MAX_REPORT_AGE).expect("uptime");
            last[0].memory.free = 7;
        }
        assert_ne!(reports.memory(&cpu, (1, 3)).free, 7);
        // Off: always the device's.
        let off = MemoryReports {
            off: true,
            ..MemoryReports::default()
        };
        assert_eq!(off.memory(&cpu, (0, 0)).total, first.total);
    }
}
