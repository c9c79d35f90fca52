//! The simulated discrete device: allocation limits and the high-water mark, separate device
//! memory with counted transfers, bit-exact compute against the CPU backend, the scheduler
//! over [sim, cpu], graph-allocator failure past the device size, lagging and wrapped memory
//! reports, and independence of two devices.

use sd_tensor::ggml::{
    Backend, Buffer, BufferType, BufferUsage, Context, DeviceKind, GTensor, Gallocr, Graph,
    Interpolation, Scheduler, SimDevice, SimOptions,
};
use sd_tensor::{DType, GgmlError};
use sd_testutil::{bits, f16_round, rnd};

fn sim(name: &str, total: u64) -> SimDevice {
    SimDevice::new(name, total, SimOptions::default()).unwrap()
}

#[test]
fn allocation_past_the_size_fails_and_the_high_water_mark_is_exact() {
    let dev = sim("SIM-alloc", 1 << 20);
    let bt = dev.buffer_type();
    assert!(!bt.is_host());
    assert_eq!(bt.name(), "SIM-alloc");
    assert_eq!(bt.alignment(), 128);
    assert!(dev.owns_buffer_type(bt));
    assert!(!dev.owns_buffer_type(BufferType::cpu()));
    let d = dev.device();
    assert_eq!(d.name(), "SIM-alloc");
    assert_eq!(d.kind(), DeviceKind::Gpu);
    assert_eq!(d.buffer_type().unwrap(), bt);
    assert_eq!(bt.device(), Some(d));
    assert!(d.host_buffer_type().is_none());
    assert!(sd_tensor::ggml::Device::all().iter().all(|x| *x != d));

    let a = bt.alloc(600_000).unwrap();
    assert!(!a.is_host());
    assert_eq!(a.size(), 600_000);
    let s = dev.stats();
    assert_eq!(
        (s.live_bytes, s.peak_bytes, s.live_buffers, s.allocations),
        (600_000, 600_000, 1, 1)
    );

    // Past the size: an error, nothing changes but the failure count.
    let err = bt.alloc(500_000).unwrap_err();
    assert!(
        matches!(err, GgmlError::AllocationFailed { bytes: 500_000, .. }),
        "{err}"
    );
    let s = dev.stats();
    assert_eq!(
        (s.live_bytes, s.failed_allocations, s.allocations),
        (600_000, 1, 1)
    );

    let b = bt.alloc(400_000).unwrap();
    assert_eq!(dev.peak_bytes(), 1_000_000);
    drop(a);
    assert_eq!(dev.live_bytes(), 400_000);
    assert_eq!(dev.peak_bytes(), 1_000_000, "the peak survives frees");

    // Exactly filling the device works; one more byte does not.
    let rest = (1u64 << 20) - 400_000;
    let c = bt.alloc(rest as usize).unwrap();
    assert_eq!(dev.memory().free, 0);
    assert_eq!(dev.memory().total, 1 << 20);
    assert_eq!(dev.peak_bytes(), 1 << 20);
    assert!(bt.alloc(1).is_err());
    drop(c);
    assert_eq!(dev.memory().free, (1 << 20) - 400_000);

    // The failure hook.
    dev.fail_next_allocations(2);
    assert!(bt.alloc(16).is_err());
    assert!(bt.alloc(16).is_err());
    let d16 = bt.alloc(16).unwrap();
    drop((b, d16));
    let s = dev.stats();
    assert_eq!(s.live_bytes, 0);
    assert_eq!(s.live_buffers, 0);
    assert_eq!(s.allocations, 4);
    assert_eq!(s.frees, 4);
    assert_eq!(s.failed_allocations, 4);
    assert_eq!(s.peak_bytes, 1 << 20);
    assert_eq!(s.faults, 0);
    dev.reset_peak();
    assert_eq!(dev.peak_bytes(), 0);

    // A buffer larger than the device's largest allocation.
    let capped = SimDevice::new(
        "SIM-capped",
        1 << 20,
        SimOptions {
            max_buffer_size: Some(1000),
            ..SimOptions::default()
        },
    )
    .unwrap();
    assert_eq!(capped.buffer_type().max_size(), 1000);
    assert!(capped.buffer_type().alloc(1001).is_err());
    assert!(capped.buffer_type().alloc(1000).is_ok());
}

#[test]
fn device_memory_is_separate_and_transfers_are_counted() {
    let dev = sim("SIM-xfer", 1 << 20);
    let bt = dev.buffer_type();
    let ctx = Context::new_descriptors(8, 8, 1).unwrap();
    let t = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let u = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let w = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let h = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let buf = bt.alloc(4096).unwrap();
    let buf2 = bt.alloc(1024).unwrap();
    let host = BufferType::cpu().alloc(1024).unwrap();
    assert!(
        buf.place(&t, 100).is_err(),
        "placements follow the device alignment"
    );
    buf.place(&t, 0).unwrap();
    buf.place(&u, 1024).unwrap();
    buf2.place(&w, 0).unwrap();
    host.place(&h, 0).unwrap();
    assert!(!t.is_host() && !w.is_host() && h.is_host());
    assert!(dev.owns_tensor(&t) && dev.owns_tensor(&w) && !dev.owns_tensor(&h));

    // Fresh device memory is zeroed by default.
    assert_eq!(t.read_f32().unwrap(), vec![0.0; 256]);
    dev.reset_counters();

    let v: Vec<f32> = (0..256).map(|i| i as f32 * 0.25 - 3.0).collect();
    t.write_f32(&v).unwrap();
    let s = dev.stats();
    assert_eq!((s.host_to_device_bytes, s.host_to_device_copies), (1024, 1));
    assert_eq!(s.device_to_host_bytes, 0);
    assert_eq!(t.read_f32().unwrap(), v);
    let s = dev.stats();
    assert_eq!((s.device_to_host_bytes, s.device_to_host_copies), (1024, 1));
    // A partial write counts only its bytes.
    t.write_bytes(8, &[0u8; 12]).unwrap();
    assert_eq!(dev.stats().host_to_device_bytes, 1036);
    t.write_f32(&v).unwrap();
    dev.reset_counters();

    // Device to device, within one buffer and across buffers: no host traffic.
    Backend::copy_tensor(&t, &u).unwrap();
    Backend::copy_tensor(&u, &w).unwrap();
    let s = dev.stats();
    assert_eq!(
        (s.device_to_device_bytes, s.device_to_device_copies),
        (2048, 2)
    );
    assert_eq!((s.host_to_device_bytes, s.device_to_host_bytes), (0, 0));
    // Device to host and back.
    Backend::copy_tensor(&w, &h).unwrap();
    assert_eq!(h.read_f32().unwrap(), v);
    h.write_f32(&vec![1.5; 256]).unwrap();
    Backend::copy_tensor(&h, &t).unwrap();
    let s = dev.stats();
    assert_eq!(s.device_to_host_bytes, 1024);
    assert_eq!(s.host_to_device_bytes, 1024);
    assert_eq!(dev.stats().device_to_device_copies, 2);
    // Clearing is device-side.
    buf.clear(0);
    assert_eq!(dev.stats().host_to_device_bytes, 1024);
    assert_eq!(t.read_f32().unwrap(), vec![0.0; 256]);
    assert_eq!(dev.stats().faults, 0);

    // The CPU backend cannot use device buffers, the device cannot use host buffers.
    let cpu = Backend::cpu(1).unwrap();
    let simb = dev.backend().unwrap();
    assert_eq!(simb.name(), "SIM-xfer");
    assert!(!simb.is_cpu());
    assert_eq!(simb.device(), Some(dev.device()));
    assert_eq!(simb.buffer_type(), bt);
    assert!(simb.supports_buffer_type(bt));
    assert!(!simb.supports_buffer_type(BufferType::cpu()));
    assert!(!cpu.supports_buffer_type(bt));

    // Dropping a buffer makes its tensors unreadable and returns the memory.
    drop(buf);
    assert!(!t.is_allocated());
    assert_eq!(dev.live_bytes(), 1024);
    drop(buf2);
    assert_eq!(dev.live_bytes(), 0);

    // A fill byte shows never-written memory.
    let nan = SimDevice::new(
        "SIM-fill",
        1 << 16,
        SimOptions {
            fill_byte: Some(0xFF),
            ..SimOptions::default()
        },
    )
    .unwrap();
    let ctx2 = Context::new_descriptors(2, 2, 1).unwrap();
    let x = ctx2.new_tensor(DType::F32, &[4]).unwrap();
    let _b = nan.buffer_type().alloc_context_tensors(&ctx2).unwrap();
    assert!(x.read_f32().unwrap().iter().all(|v| v.is_nan()));
}

/// A graph with conv2d (im2col and direct), group_norm, mul_mat, flash attention and
/// upscale; every leaf lives in one buffer of `weights`.
struct Case {
    graph: Graph,
    leaves: Vec<GTensor>,
    outputs: Vec<GTensor>,
    weights: Buffer,
}

fn build_case(weights: BufferType) -> Case {
    let ctx = Context::new_descriptors(256, 256, 1).unwrap();
    let (c, h, w, oc) = (6, 9, 11, 4);
    let x = ctx.new_tensor(DType::F32, &[w, h, c, 1]).unwrap();
    let k = ctx.new_tensor(DType::F32, &[3, 3, c, oc]).unwrap();
    let gn_in = ctx.new_tensor(DType::F32, &[5, 4, 8, 1]).unwrap();
    let ma = ctx.new_tensor(DType::F32, &[64, 33]).unwrap();
    let mb = ctx.new_tensor(DType::F32, &[64, 7]).unwrap();
    let q = ctx.new_tensor(DType::F32, &[64, 5, 2, 1]).unwrap();
    let kk = ctx.new_tensor(DType::F16, &[64, 24, 2, 1]).unwrap();
    let vv = ctx.new_tensor(DType::F16, &[64, 24, 2, 1]).unwrap();
    let up_in = ctx.new_tensor(DType::F32, &[3, 2, 2, 1]).unwrap();
    let buf = weights.alloc_context_tensors(&ctx).unwrap();
    let leaves = vec![x, k, gn_in, ma, mb, q, kk, vv, up_in];
    for (i, t) in leaves.iter().enumerate() {
        let v = rnd(t.nelements(), i as u64 + 1);
        let v = if t.dtype() == Some(DType::F16) {
            f16_round(&v)
        } else {
            v
        };
        t.write_f32(&v).unwrap();
    }
    let [x, k, gn_in, ma, mb, q, kk, vv, up_in] = &leaves[..] else {
        unreachable!()
    };
    let outputs = vec![
        ctx.conv_2d(k, x, (1, 1), (1, 1), (1, 1), true).unwrap(),
        ctx.conv_2d_direct(k, x, (1, 1), (1, 1), (1, 1)).unwrap(),
        ctx.group_norm(gn_in, 2, 1e-6).unwrap(),
        ctx.mul_mat(ma, mb).unwrap(),
        ctx.flash_attn_ext(q, kk, vv, None, 0.125).unwrap(),
        ctx.interpolate(up_in, 6, 4, Interpolation::Nearest)
            .unwrap(),
    ];
    let mut graph = Graph::new(&ctx, 256).unwrap();
    for t in &outputs {
        t.set_output();
        graph.build_forward_expand(t).unwrap();
    }
    Case {
        graph,
        leaves,
        outputs,
        weights: buf,
    }
}

fn read_all(ts: &[GTensor]) -> Vec<Vec<f32>> {
    ts.iter().map(|t| t.read_f32().unwrap()).collect()
}

#[test]
fn a_graph_on_the_device_equals_the_cpu_bit_for_bit() {
    for threads in [1, 2] {
        // Reference: everything on the CPU backend.
        let cpu = Backend::cpu(threads).unwrap();
        let reference = build_case(BufferType::cpu());
        let mut galloc = Gallocr::new(cpu.buffer_type()).unwrap();
        galloc.alloc_graph(&reference.graph).unwrap();
        cpu.compute(&reference.graph).unwrap();
        let want = read_all(&reference.outputs);

        let dev = SimDevice::new(
            "SIM-exact",
            1 << 22,
            SimOptions {
                threads,
                ..SimOptions::default()
            },
        )
        .unwrap();
        let simb = dev.backend().unwrap();
        let case = build_case(dev.buffer_type());
        let leaf_bytes: usize = case.leaves.iter().map(|t| t.nbytes()).sum();
        let s = dev.stats();
        assert_eq!(s.live_bytes, case.weights.size() as u64);
        assert_eq!(s.host_to_device_bytes, leaf_bytes as u64);
        assert_eq!(s.host_to_device_copies, case.leaves.len() as u64);
        for t in &case.graph.nodes() {
            assert!(simb.supports_op(t), "{t:?}");
        }

        let mut sim_galloc = Gallocr::new(dev.buffer_type()).unwrap();
        let compute = sim_galloc.reserve(&case.graph).unwrap();
        assert!(compute > 0);
        sim_galloc.alloc_graph(&case.graph).unwrap();
        simb.compute(&case.graph).unwrap();
        assert!(case.outputs.iter().all(|t| dev.owns_tensor(t)));
        let got = read_all(&case.outputs);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(bits(g), bits(w), "output {i} differs ({threads} threads)");
        }

        let s = dev.stats();
        let out_bytes: usize = case.outputs.iter().map(|t| t.nbytes()).sum();
        assert_eq!(s.device_to_host_bytes, out_bytes as u64);
        assert_eq!(s.graph_computes, 1);
        assert_eq!(s.allocations, 2);
        assert_eq!(s.live_bytes, (case.weights.size() + compute) as u64);
        assert_eq!(s.peak_bytes, s.live_bytes);
        assert_eq!(s.faults, 0);

        // A graph whose memory is on the host is refused, not computed.
        let err = simb.compute(&reference.graph).unwrap_err();
        assert!(matches!(err, GgmlError::ComputeFailed { .. }), "{err}");
        let s = dev.stats();
        assert_eq!((s.faults, s.graph_computes), (1, 1));

        drop(sim_galloc);
        assert_eq!(dev.live_bytes(), case.weights.size() as u64);
    }
}

/// conv2d and mul_mat whose weights live in `weights` (usage Weights) and whose inputs live
/// in `inputs`.
struct SchedCase {
    graph: Graph,
    x: GTensor,
    mb: GTensor,
    ma: GTensor,
    outputs: Vec<GTensor>,
    weights: Buffer,
    _inputs: Buffer,
}

fn build_sched_case(weights: BufferType, inputs: BufferType) -> SchedCase {
    let ctx = Context::new_descriptors(64, 64, 1).unwrap();
    let k = ctx.new_tensor(DType::F32, &[3, 3, 5, 4]).unwrap();
    let ma = ctx.new_tensor(DType::F32, &[32, 16]).unwrap();
    let wbuf = weights.alloc_context_tensors(&ctx).unwrap();
    wbuf.set_usage(BufferUsage::Weights);
    let x = ctx.new_tensor(DType::F32, &[10, 8, 5, 1]).unwrap();
    let mb = ctx.new_tensor(DType::F32, &[32, 6]).unwrap();
    let ibuf = inputs.alloc_context_tensors(&ctx).unwrap();
    for (i, t) in [&k, &ma, &x, &mb].into_iter().enumerate() {
        t.write_f32(&rnd(t.nelements(), 100 + i as u64)).unwrap();
    }
    let conv = ctx.conv_2d(&k, &x, (1, 1), (1, 1), (1, 1), true).unwrap();
    let mm = ctx.mul_mat(&ma, &mb).unwrap();
    let outputs = vec![conv, mm];
    let mut graph = Graph::new(&ctx, 64).unwrap();
    for t in &outputs {
        t.set_output();
        graph.build_forward_expand(t).unwrap();
    }
    SchedCase {
        graph,
        x,
        mb,
        ma,
        outputs,
        weights: wbuf,
        _inputs: ibuf,
    }
}

fn sched_reference() -> Vec<Vec<f32>> {
    let cpu = Backend::cpu(1).unwrap();
    let case = build_sched_case(BufferType::cpu(), BufferType::cpu());
    let mut galloc = Gallocr::new(cpu.buffer_type()).unwrap();
    galloc.alloc_graph(&case.graph).unwrap();
    cpu.compute(&case.graph).unwrap();
    read_all(&case.outputs)
}

#[test]
fn the_scheduler_copies_host_inputs_to_the_device() {
    let want = sched_reference();
    let dev = sim("SIM-sched", 1 << 22);
    let simb = dev.backend().unwrap();
    let cpu = Backend::cpu(1).unwrap();
    let case = build_sched_case(dev.buffer_type(), BufferType::cpu());
    dev.reset_counters();

    let mut sched = Scheduler::new(&[&simb, &cpu], 64, false).unwrap();
    sched.alloc_graph(&case.graph).unwrap();
    let sim_compute = sched.buffer_size(&simb).unwrap();
    assert!(sim_compute > 0);
    // The device's own accounting: weights plus the scheduler's compute buffer.
    assert_eq!(dev.live_bytes(), (case.weights.size() + sim_compute) as u64);
    sched.compute(&case.graph).unwrap();
    assert!(case.outputs.iter().all(|t| dev.owns_tensor(t)));

    let s = dev.stats();
    assert_eq!(
        s.host_to_device_bytes,
        (case.x.nbytes() + case.mb.nbytes()) as u64,
        "each host input is copied to the device once"
    );
    assert_eq!(s.host_to_device_copies, 2);
    assert_eq!(s.device_to_host_bytes, 0);
    assert!(s.graph_computes >= 1);
    assert_eq!(s.faults, 0);
    assert_eq!(s.peak_bytes, s.live_bytes);

    let got = read_all(&case.outputs);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(bits(g), bits(w));
    }
    drop(sched);
    assert_eq!(dev.live_bytes(), case.weights.size() as u64);
}

#[test]
fn an_unsupported_op_runs_on_the_cpu_and_its_weights_come_back_to_the_host() {
    let want = sched_reference();
    let dev = SimDevice::new(
        "SIM-nomm",
        1 << 22,
        SimOptions {
            unsupported_ops: vec!["MUL_MAT".into()],
            ..SimOptions::default()
        },
    )
    .unwrap();
    let simb = dev.backend().unwrap();
    let cpu = Backend::cpu(1).unwrap();
    let case = build_sched_case(dev.buffer_type(), BufferType::cpu());
    dev.reset_counters();
    let mut sched = Scheduler::new(&[&simb, &cpu], 64, false).unwrap();
    sched.alloc_graph(&case.graph).unwrap();
    sched.compute(&case.graph).unwrap();
    assert!(sched.n_splits() >= 2);
    // mul_mat (also inside conv_2d) runs on the CPU: its device weights are read back.
    let s = dev.stats();
    assert!(s.device_to_host_bytes >= case.ma.nbytes() as u64, "{s:?}");
    assert_eq!(s.faults, 0);
    let got = read_all(&case.outputs);
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(bits(g), bits(w));
    }
}

#[test]
fn the_graph_allocator_fails_cleanly_past_the_device_size() {
    let build = |dev: &SimDevice| {
        let ctx = Context::new_descriptors(8, 8, 1).unwrap();
        let a = ctx.new_tensor(DType::F32, &[1, 512]).unwrap();
        let b = ctx.new_tensor(DType::F32, &[1, 512]).unwrap();
        let buf = dev.buffer_type().alloc_context_tensors(&ctx).unwrap();
        // Weights: the scheduler keeps the op with them, on the device.
        buf.set_usage(BufferUsage::Weights);
        a.write_f32(&rnd(512, 1)).unwrap();
        b.write_f32(&rnd(512, 2)).unwrap();
        // An outer product: 512 x 512 f32 = 1 MiB of compute buffer.
        let out = ctx.mul_mat(&a, &b).unwrap();
        out.set_output();
        let mut g = Graph::new(&ctx, 8).unwrap();
        g.build_forward_expand(&out).unwrap();
        (g, out, buf)
    };

    let small = sim("SIM-small", 64 << 10);
    let (graph, out, weights) = build(&small);
    let mut galloc = Gallocr::new(small.buffer_type()).unwrap();
    let need = galloc.measure(&graph);
    assert!(need >= 1 << 20);
    let err = galloc.reserve(&graph).unwrap_err();
    assert!(matches!(err, GgmlError::AllocationFailed { .. }), "{err}");
    assert!(galloc.alloc_graph(&graph).is_err());
    assert!(!out.is_allocated());
    let s = small.stats();
    assert_eq!(s.live_bytes, weights.size() as u64);
    assert_eq!(s.failed_allocations, 2);
    assert_eq!(s.peak_bytes, weights.size() as u64);
    // The scheduler fails the same way.
    let simb = small.backend().unwrap();
    let cpu = Backend::cpu(1).unwrap();
    let mut sched = Scheduler::new(&[&simb, &cpu], 16, false).unwrap();
    assert!(sched.alloc_graph(&graph).is_err());
    assert_eq!(small.live_bytes(), weights.size() as u64);
    // Retrying after a failure fails again, cleanly.
    assert!(sched.alloc_graph(&graph).is_err());
    assert!(sched.reserve(&graph).is_err());
    assert!(sched.alloc_graph(&graph).is_err());
    assert!(galloc.alloc_graph(&graph).is_err());
    assert!(!out.is_allocated());

    let big = sim("SIM-big", 2 << 20);
    let (graph, out, weights) = build(&big);
    let mut galloc = Gallocr::new(big.buffer_type()).unwrap();
    let size = galloc.reserve(&graph).unwrap();
    galloc.alloc_graph(&graph).unwrap();
    big.backend().unwrap().compute(&graph).unwrap();
    assert_eq!(out.read_f32().unwrap().len(), 512 * 512);
    assert_eq!(big.peak_bytes(), (weights.size() + size) as u64);
}

#[test]
fn lagging_wrapped_and_integrated_reports() {
    let total = 1u64 << 20;
    let lag = SimDevice::new(
        "SIM-lag",
        total,
        SimOptions {
            lagging_reports: 2,
            ..SimOptions::default()
        },
    )
    .unwrap();
    let bt = lag.buffer_type();
    assert_eq!(lag.memory().free, total);
    let a = bt.alloc(100).unwrap();
    assert_eq!(lag.memory().free, total, "1 event: the initial value");
    let b = bt.alloc(200).unwrap();
    assert_eq!(
        lag.memory().free,
        total,
        "2 events: still the initial value"
    );
    let c = bt.alloc(300).unwrap();
    assert_eq!(lag.memory().free, total - 100);
    drop(a);
    assert_eq!(lag.memory().free, total - 300);
    assert!(
        bt.alloc(0).is_ok(),
        "zero-size buffers are ggml's dummies, not events"
    );
    drop(b);
    assert_eq!(lag.memory().free, total - 600);
    assert_eq!(lag.live_bytes(), 300);
    drop(c);
    assert_eq!(lag.memory().free, total - 500);
    // The limit uses the true live bytes, not the report.
    let full = bt.alloc(total as usize).unwrap();
    assert_eq!(lag.memory().free, total - 300);
    drop(full);

    let wrapped = SimDevice::new(
        "SIM-wrap",
        total,
        SimOptions {
            wrapped_reports: true,
            integrated: true,
            ..SimOptions::default()
        },
    )
    .unwrap();
    assert_eq!(wrapped.device().kind(), DeviceKind::IntegratedGpu);
    let m = wrapped.memory();
    assert_eq!(m.total, total);
    assert!(m.free > m.total);
    assert_eq!(m.free, usize::MAX as u64);
    let _x = wrapped.buffer_type().alloc(4096).unwrap();
    assert_eq!(wrapped.memory().free, usize::MAX as u64 - 4096);
    assert!(wrapped.device().description().contains("integrated"));
}

#[test]
fn two_devices_are_independent() {
    let a = sim("SIM-A", 1 << 16);
    let b = sim("SIM-B", 1 << 17);
    assert_ne!(a.device(), b.device());
    assert_ne!(a.buffer_type(), b.buffer_type());
    let ab = a.backend().unwrap();
    assert!(!ab.supports_buffer_type(b.buffer_type()));

    let ctx = Context::new_descriptors(4, 4, 1).unwrap();
    let ta = ctx.new_tensor(DType::F32, &[64]).unwrap();
    let tb = ctx.new_tensor(DType::F32, &[64]).unwrap();
    let ba = a.buffer_type().alloc(1 << 15).unwrap();
    let bb = b.buffer_type().alloc(1 << 16).unwrap();
    ba.place(&ta, 0).unwrap();
    bb.place(&tb, 0).unwrap();
    assert!(a.owns_tensor(&ta) && !a.owns_tensor(&tb) && b.owns_tensor(&tb));
    assert_eq!(a.memory().free, 1 << 15);
    assert_eq!(b.memory().free, 1 << 16);
    let fill = a.buffer_type().alloc(1 << 15).unwrap();
    assert!(a.buffer_type().alloc(1).is_err());
    drop(fill);
    assert_eq!(b.stats().failed_allocations, 0);

    // A copy between two devices goes through the host: read on one, written on the other.
    let v = rnd(64, 9);
    ta.write_f32(&v).unwrap();
    a.reset_counters();
    b.reset_counters();
    Backend::copy_tensor(&ta, &tb).unwrap();
    assert_eq!(tb.read_f32().unwrap(), v);
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        (sa.device_to_host_bytes, sa.device_to_device_bytes),
        (256, 0)
    );
    assert_eq!(
        (sb.host_to_device_bytes, sb.device_to_device_bytes),
        (256, 0)
    );
    assert_eq!(sb.device_to_host_bytes, 256, "the read-back above");
}

#[test]
fn buffers_and_backends_outlive_the_handle() {
    let dev = sim("SIM-life", 1 << 16);
    let bt = dev.buffer_type();
    let d = dev.device();
    let backend = dev.backend().unwrap();
    let ctx = Context::new_descriptors(4, 4, 1).unwrap();
    let t = ctx.new_tensor(DType::F32, &[16]).unwrap();
    let buf = bt.alloc_context_tensors(&ctx).unwrap();
    drop(dev);
    // The state lives on in the buffer and the backend.
    t.write_f32(&[2.0; 16]).unwrap();
    assert_eq!(t.read_f32().unwrap(), vec![2.0; 16]);
    assert_eq!(d.memory().free, (1 << 16) - buf.size() as u64);
    assert!(bt.alloc(64).is_ok());
    drop(buf);
    assert_eq!(d.memory().free, 1 << 16);
    drop(backend);
    // Everything is gone: the descriptors stay valid and refuse work.
    assert_eq!(d.memory().free, 0);
    assert_eq!(d.memory().total, 0);
    assert!(bt.alloc(64).is_err());
    assert!(d.init_backend().is_err());
    assert_eq!(d.name(), "SIM-life");
    assert!(SimDevice::new("bad\0name", 1, SimOptions::default()).is_err());
    assert!(SimDevice::new(
        "SIM-align",
        1,
        SimOptions {
            alignment: 3,
            ..SimOptions::default()
        }
    )
    .is_err());
}

#[test]
fn allocation_succeeds_on_retry_once_memory_is_freed() {
    // The engine's eviction loop: an allocation fails, something is freed, it is retried.
    let build = |bt: BufferType| {
        let ctx = Context::new_descriptors(8, 8, 1).unwrap();
        let a = ctx.new_tensor(DType::F32, &[1, 512]).unwrap();
        let b = ctx.new_tensor(DType::F32, &[1, 512]).unwrap();
        let buf = bt.alloc_context_tensors(&ctx).unwrap();
        buf.set_usage(BufferUsage::Weights);
        a.write_f32(&rnd(512, 3)).unwrap();
        b.write_f32(&rnd(512, 4)).unwrap();
        let out = ctx.mul_mat(&a, &b).unwrap();
        out.set_output();
        let mut g = Graph::new(&ctx, 8).unwrap();
        g.build_forward_expand(&out).unwrap();
        (g, out, buf)
    };
    let cpu = Backend::cpu(1).unwrap();
    let (g, out, _w) = build(BufferType::cpu());
    let mut galloc = Gallocr::new(cpu.buffer_type()).unwrap();
    galloc.alloc_graph(&g).unwrap();
    cpu.compute(&g).unwrap();
    let want = bits(&out.read_f32().unwrap());

    let dev = sim("SIM-retry", 3 << 19);
    let simb = dev.backend().unwrap();
    let (g, out, weights) = build(dev.buffer_type());

    // Graph allocator.
    let hog = dev.buffer_type().alloc(1 << 20).unwrap();
    let mut galloc = Gallocr::new(dev.buffer_type()).unwrap();
    assert!(galloc.alloc_graph(&g).is_err());
    drop(hog);
    galloc.alloc_graph(&g).unwrap();
    simb.compute(&g).unwrap();
    assert_eq!(bits(&out.read_f32().unwrap()), want);
    drop(galloc);

    // Scheduler.
    let hog = dev.buffer_type().alloc(1 << 20).unwrap();
    let mut sched = Scheduler::new(&[&simb, &cpu], 16, false).unwrap();
    assert!(sched.alloc_graph(&g).is_err());
    assert!(sched.alloc_graph(&g).is_err());
    drop(hog);
    sched.alloc_graph(&g).unwrap();
    assert!(dev.owns_tensor(&out));
    sched.compute(&g).unwrap();
    assert_eq!(bits(&out.read_f32().unwrap()), want);
    assert_eq!(
        dev.live_bytes(),
        (weights.size() + sched.buffer_size(&simb).unwrap()) as u64
    );
    assert_eq!(dev.peak_bytes(), weights.size() as u64 + (1 << 20));
    assert_eq!(dev.stats().faults, 0);
    drop(sched);

    // Host inputs, the op pinned to the device. The scheduler copies the inputs in, even
    // when the same graph was split before (a reservation, a failed allocation).
    let (g, out, _inputs) = build(BufferType::cpu());
    let srcs = out.srcs();
    let in_bytes: usize = srcs.iter().map(|t| t.nbytes()).sum();
    assert_eq!(in_bytes, 4096);
    let mut sched = Scheduler::new(&[&simb, &cpu], 16, false).unwrap();
    sched.set_tensor_backend(&out, &simb).unwrap();
    sched.reserve(&g).unwrap();
    sched.set_tensor_backend(&out, &simb).unwrap();
    sched.alloc_graph(&g).unwrap();
    assert!(dev.owns_tensor(&out));
    dev.reset_counters();
    sched.compute(&g).unwrap();
    assert_eq!(dev.stats().host_to_device_bytes, in_bytes as u64);
    assert_eq!(bits(&out.read_f32().unwrap()), want);
    drop(sched);

    let hog = dev.buffer_type().alloc(1 << 20).unwrap();
    let mut sched = Scheduler::new(&[&simb, &cpu], 16, false).unwrap();
    sched.set_tensor_backend(&out, &simb).unwrap();
    assert!(sched.alloc_graph(&g).is_err());
    drop(hog);
    sched.alloc_graph(&g).unwrap();
    assert!(
        dev.owns_tensor(&out),
        "the pin survives the failed allocation"
    );
    dev.reset_counters();
    sched.compute(&g).unwrap();
    assert_eq!(dev.stats().host_to_device_bytes, in_bytes as u64);
    assert_eq!(bits(&out.read_f32().unwrap()), want);
    drop(sched);

    // Once the scheduler is gone the graph reads its own sources again.
    assert_eq!(out.srcs(), srcs);
    let mut galloc = Gallocr::new(cpu.buffer_type()).unwrap();
    galloc.alloc_graph(&g).unwrap();
    cpu.compute(&g).unwrap();
    assert_eq!(bits(&out.read_f32().unwrap()), want);
}

#[test]
fn measuring_a_larger_graph_leaves_the_allocated_one_alone() {
    let dev = sim("SIM-measure", 8 << 20);
    let simb = dev.backend().unwrap();
    let ctx = Context::new_descriptors(16, 16, 2).unwrap();
    let a = ctx.new_tensor(DType::F32, &[1, 256]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[1, 1024]).unwrap();
    let _w = dev.buffer_type().alloc_context_tensors(&ctx).unwrap();
    a.write_f32(&rnd(256, 5)).unwrap();
    b.write_f32(&rnd(1024, 6)).unwrap();
    let small = ctx.mul_mat(&a, &a).unwrap();
    let large = ctx.mul_mat(&b, &b).unwrap();
    let mut g1 = Graph::new(&ctx, 4).unwrap();
    g1.build_forward_expand(&small).unwrap();
    let mut g2 = Graph::new(&ctx, 4).unwrap();
    g2.build_forward_expand(&large).unwrap();

    let mut galloc = Gallocr::new(dev.buffer_type()).unwrap();
    galloc.alloc_graph(&g1).unwrap();
    let live = dev.live_bytes();
    assert!(galloc.measure(&g2) >= 4 << 20);
    // The device sees no buffer freed under the allocated graph.
    assert_eq!(dev.live_bytes(), live);
    assert!(small.is_allocated());
    simb.compute(&g1).unwrap();
    assert_eq!(small.read_f32().unwrap().len(), 256 * 256);
    assert_eq!(dev.stats().faults, 0);
}

#[test]
fn weights_split_over_several_device_buffers() {
    // A largest-allocation limit makes ggml spread context tensors over several device
    // buffers behind one multi-buffer.
    let dev = SimDevice::new(
        "SIM-multi",
        1 << 16,
        SimOptions {
            max_buffer_size: Some(1024),
            ..SimOptions::default()
        },
    )
    .unwrap();
    let ctx = Context::new_descriptors(8, 8, 1).unwrap();
    let a = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let b = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let c = ctx.new_tensor(DType::F32, &[256]).unwrap();
    let buf = dev.buffer_type().alloc_context_tensors(&ctx).unwrap();
    assert_eq!(buf.size(), 3072);
    let s = dev.stats();
    assert_eq!((s.allocations, s.live_buffers, s.live_bytes), (3, 3, 3072));
    assert!([&a, &b, &c].iter().all(|t| dev.owns_tensor(t)));
    a.write_f32(&rnd(256, 1)).unwrap();
    b.write_f32(&rnd(256, 2)).unwrap();
    c.write_f32(&rnd(256, 3)).unwrap();
    let sum = ctx.add(&a, &b).unwrap();
    let sum = ctx.add(&sum, &c).unwrap();
    let mut g = Graph::new(&ctx, 8).unwrap();
    g.build_forward_expand(&sum).unwrap();
    let mut galloc = Gallocr::new(dev.buffer_type()).unwrap();
    galloc.alloc_graph(&g).unwrap();
    dev.backend().unwrap().compute(&g).unwrap();
    let want: Vec<f32> = (0..256)
        .map(|i| rnd(256, 1)[i] + rnd(256, 2)[i] + rnd(256, 3)[i])
        .collect();
    assert_eq!(sum.read_f32().unwrap(), want);
    assert_eq!(dev.stats().faults, 0);
    drop(galloc);
    drop(buf);
    let s = dev.stats();
    assert_eq!((s.live_buffers, s.live_bytes), (0, 0));
}

#[test]
fn copy_tensors_merges_runs_laid_out_alike_and_copies_every_byte() {
    use sd_tensor::ggml::{Backend, BufferType, Context, SimDevice, SimOptions};
    use sd_tensor::DType;
    let sim = SimDevice::new("SIM_COALESCE", 1 << 20, SimOptions::default()).unwrap();
    let align = sim
        .buffer_type()
        .alignment()
        .max(BufferType::cpu().alignment());
    // Five f32 tensors of 3 * align bytes (sizes are multiples of both alignments).
    let n = 3 * align / 4;
    let ctx = Context::new_descriptors(16, 1, 0).unwrap();
    let mk = |i: usize| {
        let t = ctx.new_tensor(DType::F32, &[n]).unwrap();
        t.set_name(&format!("t{i}"));
        t
    };
    let srcs: Vec<_> = (0..5).map(mk).collect();
    let dsts: Vec<_> = (5..10).map(mk).collect();
    let host = BufferType::cpu().alloc(5 * n * 4).unwrap();
    let dev = sim.buffer_type().alloc(6 * n * 4).unwrap();
    for (i, t) in srcs.iter().enumerate() {
        host.place(t, i * n * 4).unwrap();
        t.write_f32(&(0..n).map(|k| (i * n + k) as f32).collect::<Vec<_>>())
            .unwrap();
    }
    // Destinations 0..3 mirror the sources; 3 is out of place (one slot later); 4 after it.
    for (i, t) in dsts.iter().enumerate() {
        let slot = if i >= 3 { i + 1 } else { i };
        dev.place(t, slot * n * 4).unwrap();
    }
    let pairs: Vec<_> = srcs.iter().cloned().zip(dsts.iter().cloned()).collect();
    sim.reset_counters();
    let copies = Backend::copy_tensors(&pairs).unwrap();
    // [0, 1, 2] merged, then [3, 4] merged (same relative offsets again).
    assert_eq!(copies, 2);
    assert_eq!(sim.stats().host_to_device_copies, 2);
    for (s, d) in srcs.iter().zip(&dsts) {
        assert_eq!(s.read_f32().unwrap(), d.read_f32().unwrap());
    }
    // Reversed order: nothing merges, still every byte right.
    let rev: Vec<_> = pairs.iter().rev().cloned().collect();
    sim.reset_counters();
    assert_eq!(Backend::copy_tensors(&rev).unwrap(), 5);
    assert_eq!(sim.stats().host_to_device_copies, 5);
}
