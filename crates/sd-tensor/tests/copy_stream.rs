//! Copy streams and events: uploads queued on a second backend of a simulated device with
//! queued copies take effect only once ordered (an event waited on or synchronised), single
//! and coalesced; backends without events or queued copies have no copy stream.

use sd_tensor::ggml::{
    Backend, BufferType, Context, CopyStream, Event, GTensor, SimDevice, SimOptions,
};
use sd_tensor::DType;

fn async_sim(name: &str) -> SimDevice {
    SimDevice::new(
        name,
        1 << 20,
        SimOptions {
            async_transfers: true,
            ..SimOptions::default()
        },
    )
    .unwrap()
}

/// `n` f32 tensors of `len` values each in one context (descriptors only).
fn tensors(n: usize, len: usize) -> (Context, Vec<GTensor>) {
    let ctx = Context::new_descriptors(n, 1, 0).unwrap();
    let ts = (0..n)
        .map(|_| ctx.new_tensor(DType::F32, &[len]).unwrap())
        .collect();
    (ctx, ts)
}

fn values(seed: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (seed * 1000 + i) as f32 * 0.5).collect()
}

#[test]
fn backends_without_events_or_queued_copies_have_no_copy_stream() {
    let cpu = Backend::cpu(1).unwrap();
    assert!(!cpu.supports_events());
    assert!(CopyStream::new(&cpu).is_none());
    let plain = SimDevice::new("SIM-nostream", 1 << 20, SimOptions::default()).unwrap();
    let b = plain.backend().unwrap();
    assert!(!b.supports_events() && !b.supports_async_set());
    assert!(CopyStream::new(&b).is_none());
    assert!(Event::new(plain.device()).is_none());
    let queued = async_sim("SIM-stream-caps");
    let b = queued.backend().unwrap();
    assert!(b.supports_events() && b.supports_async_set());
    assert!(CopyStream::new(&b).is_some());
}

#[test]
fn queued_uploads_take_effect_when_the_compute_backend_waits_on_their_event() {
    let dev = async_sim("SIM-stream-order");
    let compute = dev.backend().unwrap();
    let stream = CopyStream::new(&compute).unwrap();
    let (_sctx, src) = tensors(3, 64);
    let (_dctx, dst) = tensors(3, 64);
    let host = BufferType::cpu().alloc_context_tensors(&_sctx).unwrap();
    let device = dev.buffer_type().alloc_context_tensors(&_dctx).unwrap();
    for (i, s) in src.iter().enumerate() {
        s.write_f32(&values(i, 64)).unwrap();
    }
    let pairs: Vec<(GTensor, GTensor)> = src.iter().cloned().zip(dst.iter().cloned()).collect();
    assert!(pairs.iter().all(|(s, d)| stream.queues(s, d)));
    // The compute stream has worked before: the uploads are ordered after it.
    stream.after(&compute).unwrap();
    // SAFETY: the sources and destinations live until the end of the test, past the event.
    let queued = unsafe { stream.upload(&pairs, false) }.unwrap();
    assert_eq!(queued, 3);
    let s = dev.stats();
    assert_eq!(
        (s.queued_host_to_device_copies, s.host_to_device_copies),
        (3, 0)
    );
    // Not ordered after the uploads: the device memory is as it was.
    assert!(dst[0].read_f32().unwrap().iter().all(|v| *v == 0.0));
    let event = stream.record().unwrap();
    compute.wait_event(&event).unwrap();
    for (i, d) in dst.iter().enumerate() {
        assert_eq!(d.read_f32().unwrap(), values(i, 64), "tensor {i}");
    }
    assert_eq!(dev.stats().host_to_device_bytes, 3 * 64 * 4);
    // A later upload of new values is ordered by synchronising its event on the host.
    src[1].write_f32(&values(7, 64)).unwrap();
    // SAFETY: as above.
    unsafe { stream.upload(&pairs[1..2], false) }.unwrap();
    assert_eq!(dst[1].read_f32().unwrap(), values(1, 64));
    let event = stream.record().unwrap();
    event.synchronize();
    assert_eq!(dst[1].read_f32().unwrap(), values(7, 64));
    assert_eq!(dev.stats().faults, 0);
    drop((host, device));
}

#[test]
fn coalesced_uploads_queue_one_copy_per_run_and_pairs_it_cannot_queue_are_copied_now() {
    let dev = async_sim("SIM-stream-coalesce");
    let compute = dev.backend().unwrap();
    let stream = CopyStream::new(&compute).unwrap();
    // Sources back to back in one host buffer, destinations at the same offsets (256-byte
    // tensors: no padding at the device's 128-byte alignment).
    let (sctx, src) = tensors(4, 64);
    let (dctx, dst) = tensors(4, 64);
    let _host = BufferType::cpu().alloc_context_tensors(&sctx).unwrap();
    let _device = dev.buffer_type().alloc_context_tensors(&dctx).unwrap();
    for (i, s) in src.iter().enumerate() {
        s.write_f32(&values(i, 64)).unwrap();
    }
    let pairs: Vec<(GTensor, GTensor)> = src.iter().cloned().zip(dst.iter().cloned()).collect();
    // SAFETY: everything lives past the event below.
    let queued = unsafe { stream.upload(&pairs, true) }.unwrap();
    assert_eq!(queued, 1, "one run");
    assert_eq!(dev.stats().queued_host_to_device_copies, 1);
    stream.record().unwrap().synchronize();
    for (i, d) in dst.iter().enumerate() {
        assert_eq!(d.read_f32().unwrap(), values(i, 64), "tensor {i}");
    }
    // A destination in host memory cannot be queued: copied synchronously.
    let (hctx, h) = tensors(1, 64);
    let _hbuf = BufferType::cpu().alloc_context_tensors(&hctx).unwrap();
    assert!(!stream.queues(&src[0], &h[0]));
    // SAFETY: as above.
    let queued = unsafe { stream.upload(&[(src[2].clone(), h[0].clone())], true) }.unwrap();
    assert_eq!(queued, 0);
    assert_eq!(h[0].read_f32().unwrap(), values(2, 64));
    assert_eq!(dev.stats().faults, 0);
}

#[test]
fn dropping_the_stream_finishes_its_copies() {
    let dev = async_sim("SIM-stream-drop");
    let compute = dev.backend().unwrap();
    let stream = CopyStream::new(&compute).unwrap();
    let (sctx, src) = tensors(1, 32);
    let (dctx, dst) = tensors(1, 32);
    let _host = BufferType::cpu().alloc_context_tensors(&sctx).unwrap();
    let _device = dev.buffer_type().alloc_context_tensors(&dctx).unwrap();
    src[0].write_f32(&values(3, 32)).unwrap();
    // SAFETY: the stream is dropped (and its copies done) before the buffers.
    unsafe { stream.upload(&[(src[0].clone(), dst[0].clone())], false) }.unwrap();
    drop(stream);
    assert_eq!(dst[0].read_f32().unwrap(), values(3, 32));
}

/// A graph queued with `compute_async` on a device with queued work is in flight until the
/// host waits for it: the simulated device counts a fault for each access a GPU would let
/// race with it (the host writing a source, reading an output, freeing its memory; a copy
/// queued on another stream without waiting on an event after it), and none once waited
/// for (the backend synchronised, an event recorded after it synchronised, or the copy
/// stream ordered after it).
#[test]
fn graphs_in_flight_race_with_unordered_accesses() {
    let dev = async_sim("SIM-in-flight");
    let compute = dev.backend().unwrap();
    let stream = CopyStream::new(&compute).unwrap();
    let ctx = Context::new_descriptors(8, 8, 1).unwrap();
    let x = ctx.new_tensor(DType::F32, &[64]).unwrap();
    let y = ctx.scale(&x, 2.0).unwrap();
    y.set_output();
    let mut graph = sd_tensor::ggml::Graph::new(&ctx, 8).unwrap();
    graph.build_forward_expand(&y).unwrap();
    let _mem = dev.buffer_type().alloc_context_tensors(&ctx).unwrap();
    let (_hctx, host) = tensors(1, 64);
    let _hbuf = BufferType::cpu().alloc_context_tensors(&_hctx).unwrap();
    host[0].write_f32(&values(1, 64)).unwrap();
    let faults = |n: u64, what: &str| assert_eq!(dev.stats().faults, n, "{what}");
    let queue = |what: &str| {
        x.write_f32(&values(0, 64)).unwrap();
        // SAFETY: the tensors live until the end of the test; every access below is
        // either a deliberate race (counted by the simulated device) or waits first.
        unsafe { compute.compute_async(&graph) }.expect(what);
    };

    queue("first");
    let _ = y.read_f32().unwrap();
    faults(1, "reading an output in flight");
    x.write_f32(&values(2, 64)).unwrap();
    faults(2, "writing a source in flight");
    // SAFETY: see above (a deliberate race).
    unsafe { stream.upload(&[(host[0].clone(), x.clone())], false) }.unwrap();
    faults(3, "a copy queued on another stream into a source in flight");
    compute.synchronize();
    stream.backend().synchronize();
    let want: Vec<f32> = values(0, 64).iter().map(|v| v * 2.0).collect();
    assert_eq!(
        y.read_f32().unwrap(),
        want,
        "computed from the first values"
    );
    faults(3, "after synchronising");

    queue("second");
    let done = Event::new(dev.device()).unwrap();
    done.record(&compute).unwrap();
    done.synchronize();
    let _ = y.read_f32().unwrap();
    faults(3, "after an event recorded after the graph");

    queue("third");
    stream.after(&compute).unwrap();
    // SAFETY: ordered after the graph by `after`.
    unsafe { stream.upload(&[(host[0].clone(), x.clone())], false) }.unwrap();
    faults(3, "a copy ordered after the graph");
    stream.backend().synchronize();
    compute.synchronize();
    assert_eq!(
        x.read_f32().unwrap(),
        values(1, 64),
        "the ordered copy landed"
    );
    faults(3, "end");
}
