//! ggml CPU matmul throughput through the safe layer: the ceiling later benchmarks are held
//! against. Reported as elements/s where one element is one floating point operation, so
//! criterion's "Gelem/s" reads as GFLOP/s.
//!
//! `cargo bench -p sd-tensor --bench matmul` (or `cargo xtask bench matmul`); set
//! `SD_BENCH_THREADS` (default 2) and `SD_BENCH_N` (default 2048).
// `criterion_group!` defines public functions without docs.
#![allow(missing_docs)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use sd_tensor::ggml::{Backend, BufferType, Context, Gallocr, Graph};
use sd_tensor::DType;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn bench_matmul(c: &mut Criterion) {
    let n = env_usize("SD_BENCH_N", 2048);
    let threads = env_usize("SD_BENCH_THREADS", 2);
    let backend = Backend::cpu(threads).expect("CPU backend");
    let mut group = c.benchmark_group(format!("matmul_{n}_{threads}t"));
    group.sample_size(10);
    group.throughput(Throughput::Elements(2 * (n as u64).pow(3)));
    for dtype in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
    ] {
        let ctx = Context::new_descriptors(8, 8, 1).unwrap();
        let a = ctx.new_tensor(dtype, &[n, n]).unwrap();
        let b = ctx.new_tensor(DType::F32, &[n, n]).unwrap();
        let _buf = BufferType::cpu().alloc_context_tensors(&ctx).unwrap();
        let vals: Vec<f32> = (0..n * n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
            .collect();
        a.write_f32(&vals).unwrap();
        b.write_f32(&vals).unwrap();
        let out = ctx.mul_mat(&a, &b).unwrap();
        out.set_output();
        let mut g = Graph::new(&ctx, 8).unwrap();
        g.build_forward_expand(&out).unwrap();
        let mut galloc = Gallocr::new(backend.buffer_type()).unwrap();
        galloc.alloc_graph(&g).unwrap();
        group.bench_function(dtype.name(), |bench| {
            bench.iter(|| backend.compute(&g).unwrap())
        });
    }
    group.finish();
}

criterion_group!(benches, bench_matmul);
criterion_main!(benches);
