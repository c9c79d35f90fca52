//! [`measure_runtime_reserve`]: how much of a GPU the backend's own runtime holds.
//!
//! A `--max-vram` budget counts every byte the process takes on the device, but the engine
//! only tracks the buffers it allocates. The rest belongs to the backend runtime: on CUDA the
//! context (several hundred MiB on recent GPUs and toolkits), cuBLAS handles and workspace,
//! the kernels loaded on first use, and ggml's per-device pool for operator temporaries.
//! A fixed guess (`sd_residency::capacity::CUDA_RUNTIME_RESERVE_BYTES`, 320 MiB) proved too
//! small on an H200 with CUDA 13 (about 700 MiB), so the run measures instead: it executes a
//! small warm-up graph with the kinds of operators the diffusion models use (a cuBLAS-sized
//! f16 matmul, fused attention, an im2col convolution, group norm, softmax) so that the
//! runtime has created what it creates lazily, frees everything it allocated, and reads the
//! device's used memory (`total - free`). The pool grows later with larger operators, so a
//! margin is added.
//!
//! Device allocators also round every buffer up to a unit of their own (`cudaMalloc`
//! reserves whole 2 MiB pages), which ggml does not report and which made runs with many
//! buffers (fine cuts, cut caches) overshoot their budgets by a few percent. The measurement
//! allocates a few buffers of an odd size and reads how much free memory they took; the
//! granularity found is recorded on the backend's buffer type
//! ([`sd_tensor::ggml::BufferType::set_allocation_granularity`]), so that every budget check
//! counts buffers at their footprint.
//!
//! The device reports memory for all processes: on a GPU shared with a desktop or another
//! program their memory counts too, which makes the budget conservative (never overshot).

use sd_tensor::ggml::{Backend, Context, Gallocr, Graph};
use sd_tensor::DType;

use crate::error::{ExecError, Result};

/// Added to the measured runtime memory for the growth of the backend's temporary pool in
/// operators larger than the warm-up's.
pub const RUNTIME_POOL_MARGIN_BYTES: u64 = 96 << 20;

/// What [`measure_runtime_reserve`] found on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeReserve {
    /// Device bytes in use after the warm-up, with nothing of the engine allocated.
    pub measured: u64,
    /// [`RuntimeReserve::measured`] + [`RUNTIME_POOL_MARGIN_BYTES`]: what to leave out of a
    /// budget.
    pub reserve: u64,
    /// The unit the device's allocator rounds buffers up to (1: exact sizes), as measured
    /// by [`measure_allocation_granularity`].
    pub granularity: u64,
}

/// Size of each probe buffer of [`measure_allocation_granularity`]: one byte past 2 MiB, so
/// that any rounding unit up to 2 MiB shows.
const PROBE_BYTES: usize = (2 << 20) + 1;
/// Number of probe buffers (their average smooths the device's report).
const PROBES: usize = 4;
/// Largest granularity believed (a larger reading is another program's allocation).
const MAX_GRANULARITY: u64 = 64 << 20;

/// Measures the unit `backend`'s device allocator rounds buffers up to: allocates
/// `PROBES` buffers of an odd size, reads how much free memory they took, frees them.
/// Returns 1 when the device shows no rounding (or reports no memory, as the CPU).
pub fn measure_allocation_granularity(backend: &Backend) -> Result<u64> {
    let Some(device) = backend.device() else {
        return Ok(1);
    };
    if backend.is_cpu() || device.memory().total == 0 {
        return Ok(1);
    }
    backend.synchronize();
    let before = device.memory().free;
    let buft = backend.buffer_type();
    let mut held = Vec::with_capacity(PROBES);
    for _ in 0..PROBES {
        held.push(buft.alloc(PROBE_BYTES).map_err(|source| ExecError::Ggml {
            context: format!(
                "probe buffer on {} (measuring its granularity)",
                backend.name()
            ),
            source,
        })?);
    }
    let after = device.memory().free;
    drop(held);
    let per_buffer = before.saturating_sub(after) / PROBES as u64;
    let slack = per_buffer.saturating_sub(PROBE_BYTES as u64);
    let g = if slack == 0 || slack >= MAX_GRANULARITY {
        1
    } else {
        (slack + 1).next_power_of_two()
    };
    tracing::debug!(device = %device.name(), per_buffer, granularity = g, "allocation granularity");
    Ok(g)
}

/// Runs a warm-up graph on `backend` and measures the device memory its runtime then holds
/// and its allocation granularity, which it records on the backend's buffer type; `None`
/// for backends without a device memory report (the CPU).
pub fn measure_runtime_reserve(backend: &Backend) -> Result<Option<RuntimeReserve>> {
    let Some(device) = backend.device() else {
        return Ok(None);
    };
    if backend.is_cpu() || device.memory().total == 0 {
        return Ok(None);
    }
    let _span = tracing::info_span!("measure_runtime_reserve", device = %device.name()).entered();
    warm_up(backend).map_err(|source| ExecError::Ggml {
        context: format!(
            "warm-up graph on {} (measuring its runtime)",
            backend.name()
        ),
        source,
    })?;
    backend.synchronize();
    let m = device.memory();
    let measured = m.total.saturating_sub(m.free);
    let granularity = measure_allocation_granularity(backend)?;
    backend
        .buffer_type()
        .set_allocation_granularity(granularity);
    Ok(Some(RuntimeReserve {
        measured,
        reserve: measured + RUNTIME_POOL_MARGIN_BYTES,
        granularity,
    }))
}

/// The largest operator temporaries a GPU backend allocates outside the graph's buffers to
/// run `graph`, estimated from its matrix products: ggml's CUDA backend multiplies an f16,
/// bf16 or quantized matrix by f32 activations through cuBLAS in f16, with the activations
/// converted to f16, the product written in f16 and converted back, and a quantized matrix
/// dequantized to f16, all in its memory pool, which keeps its high-water mark. The largest
/// such set over the graph's nodes (they run one at a time): `2 (n(src1) + n(dst))` bytes,
/// `+ 2 n(src0)` for a quantized matrix. Flash attention with f16 K/V and convolutions
/// (im2col tensors are graph tensors) add nothing here; the warm-up's pool and
/// [`RUNTIME_POOL_MARGIN_BYTES`] cover the small ones.
pub fn backend_temporaries(graph: &Graph) -> u64 {
    graph
        .nodes()
        .iter()
        .filter(|n| n.op_name() == "MUL_MAT")
        .filter_map(|n| {
            let (a, b) = (n.src(0)?, n.src(1)?);
            let wt = a.dtype()?;
            if wt == DType::F32 || b.dtype()? != DType::F32 {
                return None;
            }
            let mut bytes = 2 * (b.nelements() + n.nelements()) as u64;
            if wt.is_quantized() {
                bytes += 2 * a.nelements() as u64;
            }
            Some(bytes)
        })
        .max()
        .unwrap_or(0)
}

/// Builds, allocates and runs the warm-up graph; every buffer is freed on return.
fn warm_up(backend: &Backend) -> std::result::Result<(), sd_tensor::GgmlError> {
    let ctx = Context::new_descriptors(64, 64, 1)?;
    // 1. Inputs: an f16 weight large enough for the cuBLAS path, attention operands, a
    //    convolution's image and kernel.
    let w = ctx.new_tensor(DType::F16, &[512, 512])?;
    let x = ctx.new_tensor(DType::F32, &[512, 128])?;
    let q = ctx.new_tensor(DType::F32, &[64, 256, 4, 1])?;
    let k = ctx.new_tensor(DType::F16, &[64, 256, 4, 1])?;
    let v = ctx.new_tensor(DType::F16, &[64, 256, 4, 1])?;
    let img = ctx.new_tensor(DType::F32, &[32, 32, 64, 1])?;
    let ker = ctx.new_tensor(DType::F16, &[3, 3, 64, 64])?;
    let inputs = backend.buffer_type().alloc_context_tensors(&ctx)?;
    for t in [&w, &x, &q, &k, &v, &img, &ker] {
        let n: usize = t.ne().iter().product();
        let vals: Vec<f32> = (0..n).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
        t.write_f32(&vals)?;
    }
    // 2. The operators.
    let mm = ctx.mul_mat(&w, &x)?;
    let sm = ctx.soft_max(&mm)?;
    let fa = ctx.flash_attn_ext(&q, &k, &v, None, 0.125)?;
    let conv = ctx.conv_2d(&ker, &img, (1, 1), (1, 1), (1, 1), false)?;
    let gn = ctx.group_norm(&conv, 32, 1e-6)?;
    let act = ctx.silu(&gn)?;
    // 3. Run.
    let mut graph = Graph::new(&ctx, 64)?;
    for t in [&sm, &fa, &act] {
        t.set_output();
        graph.build_forward_expand(t)?;
    }
    let mut galloc = Gallocr::new(backend.buffer_type())?;
    galloc.reserve(&graph)?;
    galloc.alloc_graph(&graph)?;
    backend.compute(&graph)?;
    backend.synchronize();
    drop(galloc);
    drop(inputs);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sd_tensor::ggml::{SimDevice, SimOptions};

    #[test]
    fn temporaries_are_the_largest_converted_product() {
        let ctx = Context::new_descriptors(16, 16, 0).unwrap();
        let w16 = ctx.new_tensor(DType::F16, &[64, 32]).unwrap();
        let wq = ctx.new_tensor(DType::Q8_0, &[64, 32]).unwrap();
        let w32 = ctx.new_tensor(DType::F32, &[64, 32]).unwrap();
        let x = ctx.new_tensor(DType::F32, &[64, 100]).unwrap();
        let h16 = ctx.mul_mat(&w16, &x).unwrap(); // [32, 100]
        let f32_only = ctx.mul_mat(&w32, &x).unwrap();
        let mut g = Graph::new(&ctx, 16).unwrap();
        g.build_forward_expand(&h16).unwrap();
        g.build_forward_expand(&f32_only).unwrap();
        // x to f16 (6400 values), the product in f16 (3200): 2 bytes each.
        assert_eq!(backend_temporaries(&g), 2 * (6400 + 3200));
        // A quantized matrix is dequantized to f16 as well (2048 values).
        let hq = ctx.mul_mat(&wq, &x).unwrap();
        g.build_forward_expand(&hq).unwrap();
        assert_eq!(backend_temporaries(&g), 2 * (6400 + 3200 + 2048));
        // f32 by f32: none.
        let mut g2 = Graph::new(&ctx, 16).unwrap();
        g2.build_forward_expand(&f32_only).unwrap();
        assert_eq!(backend_temporaries(&g2), 0);
    }

    #[test]
    fn the_cpu_has_no_runtime_reserve() {
        let cpu = Backend::cpu(1).unwrap();
        assert_eq!(measure_runtime_reserve(&cpu).unwrap(), None);
    }

    #[test]
    fn the_warm_up_runs_and_leaves_nothing_allocated_on_a_device() {
        let sim = SimDevice::new("RESERVE0", 64 << 20, SimOptions::default()).unwrap();
        let backend = sim.backend().unwrap();
        let r = measure_runtime_reserve(&backend).unwrap().unwrap();
        // The simulated device has no runtime of its own: everything the warm-up allocated
        // is freed again, so only the margin remains.
        assert_eq!(r.measured, 0);
        assert_eq!(r.reserve, RUNTIME_POOL_MARGIN_BYTES);
        assert_eq!(
            r.granularity, 1,
            "the default simulated device charges exact sizes"
        );
        assert!(
            sim.stats().peak_bytes > 0,
            "the warm-up allocated on the device"
        );
    }

    #[test]
    fn the_granularity_of_a_rounding_device_is_measured_and_recorded() {
        for g in [64 << 10, 2 << 20] {
            let opts = SimOptions {
                allocation_granularity: g,
                ..SimOptions::default()
            };
            let sim = SimDevice::new(&format!("GRAN{g}"), 256 << 20, opts).unwrap();
            let backend = sim.backend().unwrap();
            assert_eq!(measure_allocation_granularity(&backend).unwrap(), g as u64);
            let r = measure_runtime_reserve(&backend).unwrap().unwrap();
            assert_eq!(r.granularity, g as u64);
            let buft = backend.buffer_type();
            assert_eq!(buft.allocation_granularity(), g as u64);
            assert_eq!(buft.footprint(1), g as u64);
            assert_eq!(buft.footprint(g as u64 + 1), 2 * g as u64);
            assert_eq!(sim.stats().live_bytes, 0, "the probes are freed");
        }
    }
}
