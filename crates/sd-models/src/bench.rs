//! Synthetic full-size models for benchmarks: the SD1.5 UNet with random weights, one
//! denoising step of it on any ggml backend, the SD1.5 VAE decoder and one decode, and the
//! FLOP count of a graph.
//!
//! Used by `crates/sd-models/benches/unet_step.rs` (`cargo xtask bench unet`, CPU) and
//! `vae_decode.rs` (`cargo xtask bench vae`); any other
//! backend (CUDA, a simulated device) can reuse [`SyntheticUnet::new`] with its buffer type
//! and [`UnetStep`] with its backend.

use std::time::Instant;

use sd_tensor::ggml::{Backend, Buffer, BufferType, GTensor, Gallocr, Graph};
use sd_tensor::DType;

use crate::unet::{UnetConfig, UnetModel};
use crate::vae::{AutoencoderKl, VaeConfig};
use crate::{ComputeOptions, GraphCtx, ParamBuilder, Params, Result};

/// Graph capacity (descriptors and nodes) of one SD1.5 UNet step.
pub const UNET_GRAPH: usize = 16384;

/// A UNet whose parameters hold random values, allocated in one buffer.
#[derive(Debug)]
pub struct SyntheticUnet {
    /// The model.
    pub model: UnetModel,
    /// Its parameters.
    pub params: Params,
    // Holds the parameters' memory.
    _buffer: Buffer,
}

/// A small deterministic generator (xorshift64*) for synthetic weights.
struct XorShift(u64);

impl XorShift {
    fn next_unit(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40;
        v as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

impl SyntheticUnet {
    /// Declares `config` with parameters stored as `dtype` (1-D parameters f32, see
    /// [`ParamBuilder::with_synthetic_dtype`]), allocates them in `buffer_type` and fills
    /// them from `seed`: weights uniform with the variance of `1 / fan_in` (activations keep
    /// their scale through the network), 1-D `weight`s 1 and biases 0.
    pub fn new(
        config: UnetConfig,
        dtype: DType,
        buffer_type: &BufferType,
        seed: u64,
    ) -> Result<Self> {
        let _span = tracing::info_span!("synthetic_unet", ?dtype).entered();
        let pb = ParamBuilder::with_synthetic_dtype(None, 4096, dtype)?;
        // As the runtime loads `--type q8_0` where its CPU kernels run.
        pb.set_unquantized_type(crate::weights::unquantized_type_for(Some(dtype), true));
        let model = UnetModel::new(&pb, config)?;
        let params = pb.finish();
        let buffer = fill_synthetic(&params, buffer_type, seed)?;
        Ok(SyntheticUnet {
            model,
            params,
            _buffer: buffer,
        })
    }

    /// The SDXL base UNet ([`UnetConfig::sdxl`]) with `dtype` weights in host memory.
    pub fn sdxl_cpu(dtype: DType, seed: u64) -> Result<Self> {
        Self::new(UnetConfig::sdxl(), dtype, &BufferType::cpu(), seed)
    }

    /// The SD1.5 UNet ([`UnetConfig::sd1`]) with `dtype` weights in host memory.
    pub fn sd15_cpu(dtype: DType, seed: u64) -> Result<Self> {
        Self::new(UnetConfig::sd1(), dtype, &BufferType::cpu(), seed)
    }
}

/// Allocates `params` in `buffer_type` and fills them from `seed`: weights uniform with the
/// variance of `1 / fan_in` (activations keep their scale through the network), 1-D
/// `weight`s 1 and biases 0.
fn fill_synthetic(params: &Params, buffer_type: &BufferType, seed: u64) -> Result<Buffer> {
    let buffer = buffer_type.alloc_context_tensors(&params.ctx)?;
    let mut rng = XorShift(seed.wrapping_mul(2).wrapping_add(0x9e37_79b9_7f4a_7c15) | 1);
    for (name, t) in &params.tensors {
        let ne = t.ne();
        let dims = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
        let n = t.nelements();
        let values: Vec<f32> = if dims <= 1 {
            let v = if name.ends_with("weight") { 1.0 } else { 0.0 };
            vec![v; n]
        } else {
            let fan_in = (n / ne[dims - 1]).max(1);
            let a = (3.0 / fan_in as f32).sqrt();
            (0..n).map(|_| a * rng.next_unit()).collect()
        };
        t.write_f32(&values)?;
    }
    Ok(buffer)
}

/// The SD1.5 VAE decoder ([`VaeConfig::default`], no encoder) with random weights of
/// `dtype` (1-D parameters f32) in host memory, decoding one `[side, side, 4, 1]` latent,
/// built and allocated on a backend, ready to run repeatedly.
pub struct VaeDecode {
    graph: BenchGraph,
    _params: Params,
    _buffer: Buffer,
}

impl std::fmt::Debug for VaeDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VaeDecode")
            .field("flops", &self.graph.flops)
            .finish_non_exhaustive()
    }
}

/// A model graph built and allocated on a backend, its auxiliary inputs written, ready to
/// run repeatedly (the part [`UnetStep`] and [`VaeDecode`] share).
struct BenchGraph {
    graph: Graph,
    _galloc: Gallocr,
    _g: GraphCtx,
    out: GTensor,
    flops: f64,
}

impl BenchGraph {
    /// The graph of `out` in `g`, allocated with `backend`'s buffer type.
    fn new(g: GraphCtx, out: GTensor, backend: &Backend) -> Result<BenchGraph> {
        out.set_output();
        let mut graph = Graph::new(&g.ctx, UNET_GRAPH)?;
        graph.build_forward_expand(&out)?;
        let mut galloc = Gallocr::new(backend.buffer_type())?;
        galloc.alloc_graph(&graph)?;
        for aux in &g.aux {
            aux.data.write_to(&aux.tensor)?;
        }
        let flops = graph_flops(&graph);
        Ok(BenchGraph {
            graph,
            _galloc: galloc,
            _g: g,
            out,
            flops,
        })
    }

    /// Runs it once on `backend`; returns the wall time in seconds.
    fn run(&self, backend: &Backend) -> Result<f64> {
        let start = Instant::now();
        backend.compute(&self.graph)?;
        Ok(start.elapsed().as_secs_f64())
    }
}

impl VaeDecode {
    /// Declares the decoder with `dtype` weights filled from `seed`, builds the decode of a
    /// fixed random latent of `side` x `side` with `opts` and allocates it on `backend`.
    pub fn new(
        dtype: DType,
        side: usize,
        opts: ComputeOptions,
        backend: &Backend,
        seed: u64,
    ) -> Result<Self> {
        let _span = tracing::info_span!("synthetic_vae", ?dtype).entered();
        let pb = ParamBuilder::with_synthetic_dtype(None, 4096, dtype)?;
        pb.set_unquantized_type(crate::weights::unquantized_type_for(Some(dtype), true));
        let config = VaeConfig {
            with_encoder: false,
            ..VaeConfig::default()
        };
        let vae = AutoencoderKl::new(&pb, config)?;
        let params = pb.finish();
        let buffer = fill_synthetic(&params, &BufferType::cpu(), seed)?;
        let mut g = GraphCtx::new(UNET_GRAPH, UNET_GRAPH, opts)?;
        g.ctx.set_f32_products(f32_products());
        let z = g.ctx.new_tensor(DType::F32, &[side, side, 4, 1])?;
        z.set_input();
        let out = vae.decode(&mut g, &z)?;
        let graph = BenchGraph::new(g, out, backend)?;
        let mut rng = XorShift(11);
        let v: Vec<f32> = (0..z.nelements()).map(|_| rng.next_unit()).collect();
        z.write_f32(&v)?;
        Ok(VaeDecode {
            graph,
            _params: params,
            _buffer: buffer,
        })
    }

    /// Runs the decode once on `backend`; returns the wall time in seconds.
    pub fn run(&self, backend: &Backend) -> Result<f64> {
        let _span = tracing::info_span!("vae_decode").entered();
        self.graph.run(backend)
    }

    /// The floating point operations of one decode ([`graph_flops`]).
    pub fn flops(&self) -> f64 {
        self.graph.flops
    }

    /// The output image (`[8 side, 8 side, 3, 1]`).
    pub fn output(&self) -> &GTensor {
        &self.graph.out
    }
}

/// The input sizes of one UNet evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepShape {
    /// Batch (2 for classifier-free guidance).
    pub batch: usize,
    /// Latent width.
    pub width: usize,
    /// Latent height.
    pub height: usize,
    /// Context tokens (77 per prompt chunk).
    pub tokens: usize,
}

impl StepShape {
    /// A 1024x1024 SDXL image with CFG: batch 2, latent 128x128, 77 tokens.
    pub const SDXL_1024_CFG: StepShape = StepShape {
        batch: 2,
        width: 128,
        height: 128,
        tokens: 77,
    };

    /// A 512x512 SD1.5 image with CFG: batch 2, latent 64x64, 77 tokens.
    pub const SD15_512_CFG: StepShape = StepShape {
        batch: 2,
        width: 64,
        height: 64,
        tokens: 77,
    };
}

/// One UNet step, built and allocated on a backend, ready to run repeatedly.
pub struct UnetStep {
    graph: BenchGraph,
}

impl std::fmt::Debug for UnetStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnetStep")
            .field("flops", &self.graph.flops)
            .finish_non_exhaustive()
    }
}

impl UnetStep {
    /// Builds the graph of `unet` on `shape` with `opts`, allocates it with `backend`'s buffer
    /// type and writes fixed inputs (latents and context from a fixed generator, timestep
    /// 500). The parameters must be readable by `backend`.
    pub fn new(
        unet: &UnetModel,
        shape: StepShape,
        opts: ComputeOptions,
        backend: &Backend,
    ) -> Result<Self> {
        let StepShape {
            batch,
            width,
            height,
            tokens,
        } = shape;
        let mut g = GraphCtx::new(UNET_GRAPH, UNET_GRAPH, opts)?;
        g.ctx.set_f32_products(f32_products());
        // bf16 weights (`SD_BENCH_WEIGHTS=bf16`): the attention's products in bf16 too, as
        // the Runtime runs `--type bf16` (`SD_BENCH_BF16_ATTENTION=0`: f32 products).
        let bf16_attention = std::env::var("SD_BENCH_BF16_ATTENTION").map_or(true, |v| v != "0");
        g.ctx.set_bf16_attention(
            crate::weights::bf16_attention_for(Some(bench_weights()), opts.host_kernels)
                && bf16_attention,
        );
        let c = unet.config.in_channels;
        let x = g.ctx.new_tensor(DType::F32, &[width, height, c, batch])?;
        let t = g.ctx.new_tensor(DType::F32, &[batch])?;
        let ctx = g
            .ctx
            .new_tensor(DType::F32, &[unet.config.context_dim, tokens, batch])?;
        // SDXL's `y` (pooled text and size embeddings).
        let y = match unet.config.adm_in_channels {
            Some(n) => Some(g.ctx.new_tensor(DType::F32, &[n, batch])?),
            None => None,
        };
        for i in [&x, &t, &ctx].into_iter().chain(y.as_ref()) {
            i.set_input();
        }
        let out = unet.forward(&mut g, &x, &t, &ctx, y.as_ref())?;
        let graph = BenchGraph::new(g, out, backend)?;
        let mut rng = XorShift(7);
        let mut fill = |t: &GTensor| -> Result<()> {
            let v: Vec<f32> = (0..t.nelements()).map(|_| rng.next_unit()).collect();
            Ok(t.write_f32(&v)?)
        };
        fill(&x)?;
        fill(&ctx)?;
        if let Some(y) = &y {
            fill(y)?;
        }
        t.write_f32(&vec![500.0; batch])?;
        Ok(UnetStep { graph })
    }

    /// Runs the step once on `backend`; returns the wall time in seconds.
    pub fn run(&self, backend: &Backend) -> Result<f64> {
        let _span = tracing::info_span!("unet_step").entered();
        self.graph.run(backend)
    }

    /// The floating point operations of one step ([`graph_flops`]).
    pub fn flops(&self) -> f64 {
        self.graph.flops
    }

    /// The output tensor (`[W, H, out_channels, B]`).
    pub fn output(&self) -> &GTensor {
        &self.graph.out
    }
}

/// Floating point operations of the matrix products of `graph`, the work that dominates a
/// diffusion model: the sum of [`sd_tensor::ggml::node_flops`] over its nodes.
pub fn graph_flops(graph: &Graph) -> f64 {
    graph.nodes().iter().map(sd_tensor::ggml::node_flops).sum()
}

/// The 1/5/15-minute load averages (`/proc/loadavg`), or "unknown": benchmarks print them
/// so that a busy machine shows in their output.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(","))
        .unwrap_or_else(|_| "unknown".into())
}

/// CPU seconds (user + system) this process has used so far: `/proc/self/stat` fields 14
/// and 15, in Linux's `USER_HZ` ticks (100 per second); 0 where unavailable.
pub fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

/// Whether a model benchmark runs convolutions and linear layers on the f32 product kernels,
/// as `sd` does:
/// `SD_F32_PRODUCTS=0` turns it off (`sd_tensor`'s `Context::set_f32_products`).
pub fn f32_products() -> bool {
    std::env::var("SD_F32_PRODUCTS").map_or(true, |v| v != "0")
}

/// The weights' type a model benchmark runs with: `SD_BENCH_WEIGHTS` (`f16`, the default,
/// `bf16` or `q8_0`, as `sd --type bf16|q8_0` loads them: q8_0 linear weights, the
/// convolution kernels as [`unquantized_type_for`](crate::weights::unquantized_type_for)
/// says).
///
/// # Panics
/// On any other value (a benchmark's usage error).
pub fn bench_weights() -> DType {
    match std::env::var("SD_BENCH_WEIGHTS").as_deref() {
        Err(_) | Ok("f16") => DType::F16,
        Ok("bf16") => DType::BF16,
        Ok("q8_0") => DType::Q8_0,
        Ok(other) => panic!("SD_BENCH_WEIGHTS={other}: f16, bf16 or q8_0"),
    }
}

/// Prints the matmul ceiling for `weights` and a run's `rate` (GFLOP/s) against it, and the
/// `RESULT matmul_weights_gflops` line `cargo xtask bench` reads: `f16_ceiling` (measured
/// by the caller) for f16 weights, else measured here with [`matmul_ceiling`].
pub fn report_weights_ceiling(
    backend: &Backend,
    weights: DType,
    f16_ceiling: f64,
    rate: f64,
    what: &str,
) -> Result<f64> {
    let c = if weights == DType::F16 {
        f16_ceiling
    } else {
        let c = matmul_ceiling(backend, weights)?;
        println!(
            "ggml {} matmul 2048^3: {c:.1} GFLOP/s; the {what} at {:.0}% of it",
            weights.name(),
            100.0 * rate / c
        );
        c
    };
    println!("RESULT matmul_weights_gflops={c:.2}");
    Ok(c)
}

/// Best GFLOP/s of a 2048^3 f16 x f32 `mul_mat` on `backend` over five runs: the ceiling
/// the model benchmarks report their rate against.
pub fn matmul_f16_ceiling(backend: &Backend) -> Result<f64> {
    matmul_ceiling(backend, DType::F16)
}

/// The ggml matmul ceiling for `dtype` weights: GFLOP/s of a 2048^3 `dtype` x f32
/// `mul_mat` on `backend` (ggml converts the f32 operand to the weights' dot-product type,
/// as in a model's linear layers), best of 5 after a warm-up.
pub fn matmul_ceiling(backend: &Backend, dtype: DType) -> Result<f64> {
    let n = 2048;
    let ctx = sd_tensor::ggml::Context::new_descriptors(8, 8, 1)?;
    let a = ctx.new_tensor(dtype, &[n, n])?;
    let b = ctx.new_tensor(DType::F32, &[n, n])?;
    let _buf = BufferType::cpu().alloc_context_tensors(&ctx)?;
    let vals: Vec<f32> = (0..n * n)
        .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 500.0)
        .collect();
    a.write_f32(&vals)?;
    b.write_f32(&vals)?;
    let out = ctx.mul_mat(&a, &b)?;
    out.set_output();
    let mut g = Graph::new(&ctx, 8)?;
    g.build_forward_expand(&out)?;
    let mut galloc = Gallocr::new(backend.buffer_type())?;
    galloc.alloc_graph(&g)?;
    backend.compute(&g)?;
    let flops = 2.0 * (n as f64).powi(3);
    let mut best = 0.0f64;
    for _ in 0..5 {
        let t = Instant::now();
        backend.compute(&g)?;
        best = best.max(flops / t.elapsed().as_secs_f64() / 1e9);
    }
    Ok(best)
}
