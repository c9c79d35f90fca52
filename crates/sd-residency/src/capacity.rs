//! Capacity arithmetic: does a piece of work fit a device, under its free memory and budget?
//!
//! The rules follow stable-diffusion.cpp's runtime (its `docs/backend.md`):
//! - a reserve of currently free device memory (512 MiB) is left for backend scratch buffers
//!   and pipelines;
//! - a free-memory report is capped at the device's total minus the bytes the manager tracks
//!   as resident (weights and runtime allocations of every owner);
//! - a report with free above total ("wrapped", as Vulkan's heap-budget subtraction can
//!   underflow) is rejected on a discrete device, and on an integrated one means "reclaim
//!   first, then trust the tracked estimate";
//! - a per-device budget (`--max-vram`) is shared by every owner on that device: the bytes it
//!   has left are the budget minus tracked weight bytes minus the runtime residency of other
//!   owners; when that is already negative, reclamation is required.
//!
//! Every sum saturates: no input overflows.

/// Bytes of currently free device memory left unused by capacity checks.
pub const DEVICE_RESERVE_BYTES: u64 = 512 << 20;

/// Device memory a CUDA backend allocates outside the tensors the manager and the engine
/// track (the cuBLAS handle and workspace, kernels loaded on first use, ggml's temporary
/// pool): 245 MiB measured on an H200 running the SD1.5 UNet (`docs/benchmarks.md`), with
/// margin. `--max-vram` budgets on such devices give the engine this much less, so that the
/// device's own peak stays within the budget.
pub const CUDA_RUNTIME_RESERVE_BYTES: u64 = 320 << 20;

/// How a device's memory relates to the host's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceClass {
    /// The CPU / host memory: capacity checks always pass (RAM is not budgeted here).
    Host,
    /// A discrete accelerator with its own memory.
    Discrete,
    /// An integrated accelerator sharing host memory.
    Integrated,
}

/// One capacity question: what a piece of work needs on one device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceMemoryRequest {
    /// Bytes the work allocates besides weights (compute workspace, caches), not yet
    /// allocated.
    pub pending_bytes: u64,
    /// Weight bytes that must be made resident on the device (not resident yet).
    pub missing_weight_bytes: u64,
    /// The requesting owner's runtime residency already on the device (its workspaces and
    /// caches), counted against its budget.
    pub owner_runtime_bytes: u64,
}

/// What the manager knows about a device at the time of the question.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceState {
    /// Device class.
    pub class: DeviceClass,
    /// Free memory reported by the backend now (`None`: no report).
    pub reported_free: Option<u64>,
    /// Total memory reported by the backend.
    pub reported_total: u64,
    /// Weight bytes the manager tracks as resident on the device (all owners).
    pub tracked_weight_bytes: u64,
    /// Runtime bytes (workspaces, caches) of all owners on the device, the requester's
    /// included.
    pub tracked_runtime_bytes: u64,
    /// Runtime bytes of owners other than the requester.
    pub other_owners_runtime_bytes: u64,
    /// The device budget (`--max-vram`), if any.
    pub budget: Option<u64>,
    /// Reserve of free memory to leave (normally [`DEVICE_RESERVE_BYTES`]).
    pub reserve_bytes: u64,
}

impl DeviceState {
    /// A device state with the default reserve and nothing tracked.
    pub fn new(class: DeviceClass, free: Option<u64>, total: u64) -> Self {
        DeviceState {
            class,
            reported_free: free,
            reported_total: total,
            tracked_weight_bytes: 0,
            tracked_runtime_bytes: 0,
            other_owners_runtime_bytes: 0,
            budget: None,
            reserve_bytes: DEVICE_RESERVE_BYTES,
        }
    }
}

/// The answer to a capacity question (stable-diffusion.cpp's `DeviceMemoryCapacity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemoryCapacity {
    /// Bytes the request needs from the device's free memory.
    pub required_device_bytes: u64,
    /// Bytes the request needs from the budget.
    pub required_budget_bytes: u64,
    /// Bytes of device memory available to it.
    pub available_device_bytes: u64,
    /// Bytes of budget available to it (`u64::MAX` without a budget).
    pub available_budget_bytes: u64,
    /// Whether memory must be reclaimed before the numbers can be trusted or met.
    pub requires_reclamation: bool,
    /// Whether the device report could be used at all.
    pub valid: bool,
    /// Whether the device reported more free than total memory.
    pub wrapped_device_report: bool,
}

impl DeviceMemoryCapacity {
    /// Whether the request fits; `after_reclamation` accepts a wrapped report once
    /// reclamation has run.
    pub fn fits(&self, after_reclamation: bool) -> bool {
        self.valid
            && !self.requires_reclamation
            && (after_reclamation || !self.wrapped_device_report)
            && self.required_device_bytes <= self.available_device_bytes
            && self.required_budget_bytes <= self.available_budget_bytes
    }

    /// Bytes missing on the device (0 if it fits there).
    pub fn device_shortfall(&self) -> u64 {
        self.required_device_bytes
            .saturating_sub(self.available_device_bytes)
    }

    /// Bytes missing from the budget (0 if it fits there).
    pub fn budget_shortfall(&self) -> u64 {
        self.required_budget_bytes
            .saturating_sub(self.available_budget_bytes)
    }
}

/// Answers a capacity question.
pub fn inspect_capacity(
    device: &DeviceState,
    request: &DeviceMemoryRequest,
) -> DeviceMemoryCapacity {
    let required_device = request
        .pending_bytes
        .saturating_add(request.missing_weight_bytes);
    let required_budget = request
        .owner_runtime_bytes
        .saturating_add(request.pending_bytes)
        .saturating_add(request.missing_weight_bytes);
    let mut cap = DeviceMemoryCapacity {
        required_device_bytes: required_device,
        required_budget_bytes: required_budget,
        available_device_bytes: u64::MAX,
        available_budget_bytes: u64::MAX,
        requires_reclamation: false,
        valid: true,
        wrapped_device_report: false,
    };
    if device.class == DeviceClass::Host {
        return cap;
    }

    // Device memory.
    let tracked = device
        .tracked_weight_bytes
        .saturating_add(device.tracked_runtime_bytes);
    let cap_by_total = device.reported_total.saturating_sub(tracked);
    match device.reported_free {
        None => cap.available_device_bytes = cap_by_total,
        Some(free) if free > device.reported_total => {
            cap.wrapped_device_report = true;
            if device.class == DeviceClass::Discrete {
                cap.valid = false;
                cap.available_device_bytes = 0;
            } else {
                // Trust the tracked estimate once reclamation has run.
                cap.available_device_bytes = device
                    .reported_total
                    .saturating_sub(device.reserve_bytes)
                    .min(cap_by_total);
            }
        }
        Some(free) => {
            cap.available_device_bytes =
                free.saturating_sub(device.reserve_bytes).min(cap_by_total);
        }
    }

    // Budget shared by every owner on the device.
    if let Some(budget) = device.budget {
        let used = device
            .tracked_weight_bytes
            .saturating_add(device.other_owners_runtime_bytes);
        if used > budget {
            cap.requires_reclamation = true;
            cap.available_budget_bytes = 0;
        } else {
            cap.available_budget_bytes = budget - used;
        }
    }
    cap
}

/// Error parsing a `--max-vram` value.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum MaxVramError {
    /// A value that is not a finite number.
    #[error("--max-vram: '{0}' is not a finite number of GiB or a size with a unit")]
    BadNumber(String),
    /// An empty key or item.
    #[error("--max-vram: empty item in '{0}'")]
    Empty(String),
    /// The same key twice.
    #[error("--max-vram: '{0}' given twice")]
    Duplicate(String),
}

/// A device budget as written by the user.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum BudgetSpec {
    /// No budget (the value 0).
    Disabled,
    /// A fixed number of bytes.
    Bytes(u64),
    /// Free device memory minus this many bytes (a negative value).
    FreeMinus(u64),
}

impl BudgetSpec {
    /// Resolves the budget against a device's free memory (`None` for no budget).
    pub fn resolve(&self, free: Option<u64>) -> Option<u64> {
        match *self {
            BudgetSpec::Disabled => None,
            BudgetSpec::Bytes(b) => Some(b),
            BudgetSpec::FreeMinus(spare) => Some(free.unwrap_or(0).saturating_sub(spare)),
        }
    }
}

/// Error parsing a size (`512M`, `1.5G`, `65536K`, `1048576B`).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("'{text}' is not a size (a number with an optional unit B, K, M or G; default unit {default_unit})")]
pub struct SizeError {
    /// The text given.
    pub text: String,
    /// The unit assumed without one.
    pub default_unit: &'static str,
}

/// Parses a byte size: a non-negative number followed by an optional unit `B`, `K`/`KiB`,
/// `M`/`MiB`, `G`/`GiB` (binary units, case-insensitive); `default_shift` (10, 20 or 30)
/// applies without a unit.
pub fn parse_size(text: &str, default_shift: u32) -> std::result::Result<u64, SizeError> {
    let unit_name = match default_shift {
        0 => "B",
        10 => "KiB",
        20 => "MiB",
        _ => "GiB",
    };
    let err = || SizeError {
        text: text.to_string(),
        default_unit: unit_name,
    };
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" => default_shift,
        "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(err()),
    };
    let v: f64 = num.parse().map_err(|_| err())?;
    if !v.is_finite() || v < 0.0 {
        return Err(err());
    }
    let bytes = v * (1u64 << shift) as f64;
    if bytes > u64::MAX as f64 {
        return Err(err());
    }
    Ok(bytes as u64)
}

/// `--max-vram`: a default budget and per-device budgets, in GiB or with a unit (`4`,
/// `512M`, `cuda0=6,cuda1=8G`, `all=-1`, `-512M`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MaxVram {
    /// Budget for devices without their own entry.
    pub default: Option<BudgetSpec>,
    /// Per-device entries, keys lower-cased.
    pub per_device: Vec<(String, BudgetSpec)>,
}

fn gib_to_spec(text: &str, v: f64) -> Result<BudgetSpec, MaxVramError> {
    if !v.is_finite() {
        return Err(MaxVramError::BadNumber(text.to_string()));
    }
    let bytes = (v.abs() * (1u64 << 30) as f64).min(u64::MAX as f64) as u64;
    Ok(if v == 0.0 {
        BudgetSpec::Disabled
    } else if v > 0.0 {
        BudgetSpec::Bytes(bytes)
    } else {
        BudgetSpec::FreeMinus(bytes)
    })
}

impl MaxVram {
    /// Parses the flag's value: comma-separated `[device=]value` items, each value a number
    /// of GiB or a size with a unit ([`parse_size`]); negative: free memory minus that; 0:
    /// no budget.
    pub fn parse(s: &str) -> Result<MaxVram, MaxVramError> {
        let mut out = MaxVram::default();
        for item in s.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(MaxVramError::Empty(s.to_string()));
            }
            let (key, val) = match item.split_once('=') {
                Some((k, v)) => (Some(k.trim().to_ascii_lowercase()), v.trim()),
                None => (None, item),
            };
            let spec = if val.ends_with(|c: char| c.is_ascii_alphabetic()) {
                let (neg, mag) = match val.strip_prefix('-') {
                    Some(m) => (true, m),
                    None => (false, val),
                };
                let bytes =
                    parse_size(mag, 30).map_err(|e| MaxVramError::BadNumber(e.to_string()))?;
                match (bytes, neg) {
                    (0, _) => BudgetSpec::Disabled,
                    (b, false) => BudgetSpec::Bytes(b),
                    (b, true) => BudgetSpec::FreeMinus(b),
                }
            } else {
                let v: f64 = val
                    .parse()
                    .map_err(|_| MaxVramError::BadNumber(val.to_string()))?;
                gib_to_spec(val, v)?
            };
            match key.as_deref() {
                None | Some("all") | Some("default") | Some("*") => {
                    if out.default.is_some() {
                        return Err(MaxVramError::Duplicate("default".into()));
                    }
                    out.default = Some(spec);
                }
                Some("") => return Err(MaxVramError::Empty(s.to_string())),
                Some(k) => {
                    if out.per_device.iter().any(|(x, _)| x == k) {
                        return Err(MaxVramError::Duplicate(k.to_string()));
                    }
                    out.per_device.push((k.to_string(), spec));
                }
            }
        }
        Ok(out)
    }

    /// The budget spec for a device name (case-insensitive), else the default.
    pub fn for_device(&self, name: &str) -> Option<BudgetSpec> {
        let n = name.to_ascii_lowercase();
        self.per_device
            .iter()
            .find(|(k, _)| *k == n)
            .map(|(_, s)| *s)
            .or(self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_vram_takes_units() {
        let m = MaxVram::parse("512M,cuda1=6,cuda0=-1.5G,x=0B").unwrap();
        assert_eq!(m.default, Some(BudgetSpec::Bytes(512 << 20)));
        assert_eq!(m.for_device("CUDA1"), Some(BudgetSpec::Bytes(6 << 30)));
        assert_eq!(m.for_device("cuda0"), Some(BudgetSpec::FreeMinus(3 << 29)));
        assert_eq!(m.for_device("x"), Some(BudgetSpec::Disabled));
        assert!(MaxVram::parse("5Q").is_err());
        assert_eq!(parse_size("65536K", 20), Ok(64 << 20));
    }

    const MIB: u64 = 1 << 20;

    fn gpu(free: u64, total: u64) -> DeviceState {
        DeviceState::new(DeviceClass::Discrete, Some(free), total)
    }

    #[test]
    fn reserve_and_cap_apply() {
        let mut d = gpu(4096 * MIB, 8192 * MIB);
        let r = DeviceMemoryRequest {
            pending_bytes: 3584 * MIB,
            ..Default::default()
        };
        assert!(inspect_capacity(&d, &r).fits(false));
        let r2 = DeviceMemoryRequest {
            pending_bytes: 3585 * MIB,
            ..Default::default()
        };
        assert!(!inspect_capacity(&d, &r2).fits(false));
        // Tracked residency caps an optimistic report.
        d.tracked_weight_bytes = 6144 * MIB;
        let c = inspect_capacity(&d, &r);
        assert_eq!(c.available_device_bytes, 2048 * MIB);
        assert!(!c.fits(false));
    }

    #[test]
    fn wrapped_reports() {
        let d = gpu(9000 * MIB, 8192 * MIB);
        let r = DeviceMemoryRequest {
            pending_bytes: MIB,
            ..Default::default()
        };
        let c = inspect_capacity(&d, &r);
        assert!(!c.valid && !c.fits(false) && !c.fits(true));
        let mut i = d;
        i.class = DeviceClass::Integrated;
        let c = inspect_capacity(&i, &r);
        assert!(c.valid && c.wrapped_device_report);
        assert!(!c.fits(false) && c.fits(true));
    }

    #[test]
    fn budgets_are_shared() {
        let mut d = gpu(80 << 30, 80 << 30);
        d.budget = Some(4096 * MIB);
        d.tracked_weight_bytes = 1024 * MIB;
        d.other_owners_runtime_bytes = 1024 * MIB;
        let r = DeviceMemoryRequest {
            pending_bytes: 1024 * MIB,
            missing_weight_bytes: 1024 * MIB,
            owner_runtime_bytes: 0,
        };
        assert!(inspect_capacity(&d, &r).fits(false));
        let r2 = DeviceMemoryRequest {
            owner_runtime_bytes: 1,
            ..r
        };
        assert!(!inspect_capacity(&d, &r2).fits(false));
        d.other_owners_runtime_bytes = 4096 * MIB;
        let c = inspect_capacity(&d, &DeviceMemoryRequest::default());
        assert!(c.requires_reclamation && !c.fits(true));
    }

    #[test]
    fn host_always_fits() {
        let d = DeviceState::new(DeviceClass::Host, Some(0), 0);
        let r = DeviceMemoryRequest {
            pending_bytes: u64::MAX,
            missing_weight_bytes: u64::MAX,
            owner_runtime_bytes: u64::MAX,
        };
        assert!(inspect_capacity(&d, &r).fits(false));
    }

    #[test]
    fn max_vram_parsing() {
        let m = MaxVram::parse("4,CUDA1=6.5, cuda2=-1 ,rpc0=0").unwrap();
        assert_eq!(m.default, Some(BudgetSpec::Bytes(4 << 30)));
        assert_eq!(m.for_device("cuda1"), Some(BudgetSpec::Bytes(6656 * MIB)));
        assert_eq!(m.for_device("CUDA2"), Some(BudgetSpec::FreeMinus(1 << 30)));
        assert_eq!(m.for_device("rpc0"), Some(BudgetSpec::Disabled));
        assert_eq!(m.for_device("vulkan0"), Some(BudgetSpec::Bytes(4 << 30)));
        assert_eq!(
            BudgetSpec::FreeMinus(1 << 30).resolve(Some(512 * MIB)),
            Some(0)
        );
        assert!(matches!(
            MaxVram::parse("x"),
            Err(MaxVramError::BadNumber(_))
        ));
        assert!(matches!(
            MaxVram::parse("inf"),
            Err(MaxVramError::BadNumber(_))
        ));
        assert!(matches!(
            MaxVram::parse("1,,2"),
            Err(MaxVramError::Empty(_))
        ));
        assert!(matches!(
            MaxVram::parse("a=1,A=2"),
            Err(MaxVramError::Duplicate(_))
        ));
        assert!(matches!(MaxVram::parse("=1"), Err(MaxVramError::Empty(_))));
    }
}
