//! Random number generators that reproduce the noise streams of stable-diffusion.cpp.
//!
//! - [`CpuRng`]: torch's CPU generator (`mt19937`) and its `torch.randn` float path, so a seed gives
//!   the same latent noise as `torch.randn(shape, generator=torch.Generator().manual_seed(seed))`.
//! - [`CudaRng`]: torch's CUDA Philox 4x32-10 stream as stable-diffusion.cpp's `rng_philox.hpp`
//!   (itself a port of AUTOMATIC1111 webui's `rng_philox.py`) emulates it on the CPU.
//!
//! - [`StdDefaultRng`]: sd.cpp's `STDDefaultRNG`, `std::default_random_engine` with
//!   `std::normal_distribution<float>` as libstdc++ computes them.
//!
//! All draw one fresh block per [`Rng::randn`] call, like sd.cpp's `RNG::randn(n)`.

use std::str::FromStr;

use sd_tensor::Tensor;

use crate::sampling::SamplingError;

/// A seeded source of standard-normal noise.
pub trait Rng {
    /// Restart the stream from `seed`.
    fn manual_seed(&mut self, seed: u64);

    /// The next `n` standard-normal values of the stream.
    fn randn(&mut self, n: usize) -> Vec<f32>;

    /// A tensor of `shape` filled with the next standard-normal values (row-major).
    fn randn_tensor(&mut self, shape: &[usize]) -> Result<Tensor<f32>, SamplingError> {
        let n = sd_tensor::host::checked_numel(shape).ok_or_else(|| {
            SamplingError::Shape(sd_tensor::host::ShapeError::Overflow {
                shape: shape.to_vec(),
            })
        })?;
        Ok(Tensor::new(shape.to_vec(), self.randn(n))?)
    }
}

/// The RNG kinds of stable-diffusion.cpp's `--rng` option.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RngKind {
    /// `cpu`: torch CPU `randn` ([`CpuRng`]).
    Cpu,
    /// `cuda`: torch CUDA Philox `randn` ([`CudaRng`]); sd.cpp's default.
    Cuda,
    /// `std_default`: C++ `std::default_random_engine` ([`StdDefaultRng`]).
    StdDefault,
}

impl RngKind {
    /// The sd.cpp name of this kind.
    pub fn name(self) -> &'static str {
        match self {
            RngKind::Cpu => "cpu",
            RngKind::Cuda => "cuda",
            RngKind::StdDefault => "std_default",
        }
    }

    /// A generator of this kind seeded with `seed`.
    pub fn create(self, seed: u64) -> Box<dyn Rng + Send> {
        match self {
            RngKind::Cpu => Box::new(CpuRng::new(seed)),
            RngKind::Cuda => Box::new(CudaRng::new(seed)),
            RngKind::StdDefault => Box::new(StdDefaultRng::new(seed)),
        }
    }
}

impl FromStr for RngKind {
    type Err = SamplingError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(RngKind::Cpu),
            "cuda" => Ok(RngKind::Cuda),
            "std_default" => Ok(RngKind::StdDefault),
            _ => Err(SamplingError::UnknownName {
                what: "rng",
                name: s.to_string(),
            }),
        }
    }
}

const MT_N: usize = 624;
const MT_M: usize = 397;
const MATRIX_A: u32 = 0x9908_b0df;
const UMASK: u32 = 0x8000_0000;
const LMASK: u32 = 0x7fff_ffff;

/// torch's CPU generator: mt19937 plus torch's `normal_` float paths.
///
/// For `n >= 16` values it follows torch's vectorised path (24-bit uniforms, Box-Muller on blocks
/// of 16, the last block recomputed from fresh uniforms when `n % 16 != 0`); for `n < 16` it
/// follows the scalar double path with its cached second Gaussian.
#[derive(Clone)]
pub struct CpuRng {
    state: Box<[u32; MT_N]>,
    left: usize,
    next: usize,
    next_gauss: Option<f64>,
}

impl std::fmt::Debug for CpuRng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuRng")
            .field("left", &self.left)
            .finish_non_exhaustive()
    }
}

impl CpuRng {
    /// A generator seeded like `torch.Generator().manual_seed(seed)`.
    pub fn new(seed: u64) -> Self {
        let mut rng = CpuRng {
            state: Box::new([0; MT_N]),
            left: 1,
            next: 0,
            next_gauss: None,
        };
        rng.manual_seed(seed);
        rng
    }

    fn twist(u: u32, v: u32) -> u32 {
        let mixed = (u & UMASK) | (v & LMASK);
        (mixed >> 1) ^ if v & 1 != 0 { MATRIX_A } else { 0 }
    }

    fn next_state(&mut self) {
        let s = &mut self.state;
        for j in 0..MT_N - MT_M {
            s[j] = s[j + MT_M] ^ Self::twist(s[j], s[j + 1]);
        }
        for j in MT_N - MT_M..MT_N - 1 {
            s[j] = s[j + MT_M - MT_N] ^ Self::twist(s[j], s[j + 1]);
        }
        s[MT_N - 1] = s[MT_M - 1] ^ Self::twist(s[MT_N - 1], s[0]);
        self.left = MT_N;
        self.next = 0;
    }

    /// The next raw 32-bit output of mt19937.
    pub fn next_u32(&mut self) -> u32 {
        self.left -= 1;
        if self.left == 0 {
            self.next_state();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^= y >> 18;
        y
    }

    fn next_u64(&mut self) -> u64 {
        let hi = self.next_u32() as u64;
        let lo = self.next_u32() as u64;
        (hi << 32) | lo
    }

    fn uniform_f32(&mut self) -> f32 {
        (self.next_u32() & ((1 << 24) - 1)) as f32 / (1u32 << 24) as f32
    }

    fn uniform_f64(&mut self) -> f64 {
        (self.next_u64() & ((1u64 << 53) - 1)) as f64 / (1u64 << 53) as f64
    }

    fn normal_f64(&mut self) -> f64 {
        if let Some(v) = self.next_gauss.take() {
            return v;
        }
        let u1 = self.uniform_f64();
        let u2 = self.uniform_f64();
        let r = (-2.0 * (-u2).ln_1p()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u1;
        self.next_gauss = Some(r * theta.sin());
        r * theta.cos()
    }

    fn normal_fill_16(data: &mut [f32]) {
        for j in 0..8 {
            let u1 = 1.0f32 - data[j];
            let u2 = data[j + 8];
            let r = (-2.0f32 * u1.ln()).sqrt();
            let theta = 2.0f32 * std::f32::consts::PI * u2;
            data[j] = r * theta.cos();
            data[j + 8] = r * theta.sin();
        }
    }
}

impl Rng for CpuRng {
    fn manual_seed(&mut self, seed: u64) {
        self.state[0] = (seed & 0xffff_ffff) as u32;
        for j in 1..MT_N {
            let prev = self.state[j - 1];
            self.state[j] = 1_812_433_253u32
                .wrapping_mul(prev ^ (prev >> 30))
                .wrapping_add(j as u32);
        }
        self.left = 1;
        self.next = 0;
        self.next_gauss = None;
    }

    fn randn(&mut self, n: usize) -> Vec<f32> {
        if n < 16 {
            return (0..n).map(|_| self.normal_f64() as f32).collect();
        }
        let mut data: Vec<f32> = (0..n).map(|_| self.uniform_f32()).collect();
        let mut i = 0;
        while i + 16 <= n {
            Self::normal_fill_16(&mut data[i..i + 16]);
            i += 16;
        }
        if !n.is_multiple_of(16) {
            let tail = &mut data[n - 16..];
            for v in tail.iter_mut() {
                *v = self.uniform_f32();
            }
            Self::normal_fill_16(tail);
        }
        data
    }
}

const PHILOX_M: [u32; 2] = [0xD251_1F53, 0xCD9E_8D57];
const PHILOX_W: [u32; 2] = [0x9E37_79B9, 0xBB67_AE85];
const TWO_POW32_INV: f32 = 2.328_306_4e-10;
const TWO_POW32_INV_2PI: f32 = 2.328_306_4e-10 * 6.283_185_5;

/// torch's CUDA `randn` stream (Philox 4x32-10 with one Box-Muller value per counter), emulated
/// on the CPU as sd.cpp's `PhiloxRNG` does: element `i` of call `k` uses counter
/// `[k, 0, i, 0]` and key `seed`.
#[derive(Clone, Debug)]
pub struct CudaRng {
    seed: u64,
    offset: u32,
}

impl CudaRng {
    /// A generator seeded with `seed` at offset 0.
    pub fn new(seed: u64) -> Self {
        CudaRng { seed, offset: 0 }
    }

    /// The ten Philox rounds for one counter/key; returns the four output words.
    pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
        let mut c = counter;
        let mut k = key;
        for round in 0..10 {
            let v1 = c[0] as u64 * PHILOX_M[0] as u64;
            let v2 = c[2] as u64 * PHILOX_M[1] as u64;
            c = [
                (v2 >> 32) as u32 ^ c[1] ^ k[0],
                v2 as u32,
                (v1 >> 32) as u32 ^ c[3] ^ k[1],
                v1 as u32,
            ];
            if round < 9 {
                k[0] = k[0].wrapping_add(PHILOX_W[0]);
                k[1] = k[1].wrapping_add(PHILOX_W[1]);
            }
        }
        c
    }

    fn box_muller(x: f32, y: f32) -> f32 {
        let u = x * TWO_POW32_INV + TWO_POW32_INV / 2.0;
        let v = y * TWO_POW32_INV_2PI + TWO_POW32_INV_2PI / 2.0;
        let s = (-2.0f32 * u.ln()).sqrt();
        s * v.sin()
    }
}

impl Rng for CudaRng {
    fn manual_seed(&mut self, seed: u64) {
        self.seed = seed;
        self.offset = 0;
    }

    fn randn(&mut self, n: usize) -> Vec<f32> {
        let key = [self.seed as u32, (self.seed >> 32) as u32];
        let offset = self.offset;
        self.offset = self.offset.wrapping_add(1);
        (0..n)
            .map(|i| {
                let g = Self::philox4x32_10([offset, 0, i as u32, 0], key);
                Self::box_muller(g[0] as f32, g[1] as f32)
            })
            .collect()
    }
}

/// `std::minstd_rand0`'s modulus (libstdc++'s `default_random_engine`).
const MINSTD_M: u64 = 2_147_483_647;
/// `std::minstd_rand0`'s multiplier.
const MINSTD_A: u64 = 16_807;

/// stable-diffusion.cpp's `STDDefaultRNG`: `std::default_random_engine` (libstdc++:
/// `minstd_rand0`) seeded with the seed cast to `unsigned int`, and a fresh
/// `std::normal_distribution<float>(0, 1)` per [`Rng::randn`] call, reproduced bit for bit as
/// libstdc++ (GCC 12) computes them:
///
/// - uniforms: `generate_canonical<float, 24>` takes one engine output `x` (its range,
///   2^31 - 2, gives 30 bits): `float(x - 1) / float(2147483646)` (the divisor rounds to
///   2^31), clamped below 1 by `nextafter(1, 0)`;
/// - normals: Marsaglia's polar method, `x = 2u - 1` rounded through `double`, `r2 = x*x +
///   y*y` in `float`, rejected when `r2 > 1` or `r2 == 0`, `mult = sqrtf(-2 * logf(r2) /
///   r2)`; it returns `y * mult` and keeps `x * mult` for the next value. The kept value
///   is dropped at the end of each call, as sd.cpp's distribution is local to `randn`.
///
/// `logf` is the C library's (Rust's `f32::ln` calls it too), so the values are those of a
/// g++ build on the same C library without FMA contraction (the x86-64 baseline).
#[derive(Clone, Debug)]
pub struct StdDefaultRng {
    state: u64,
}

impl StdDefaultRng {
    /// A generator seeded with `seed` (its low 32 bits, as sd.cpp's `(unsigned int)seed`).
    pub fn new(seed: u64) -> Self {
        let mut r = StdDefaultRng { state: 1 };
        r.manual_seed(seed);
        r
    }

    /// The next `minstd_rand0` output, in `[1, 2^31 - 2]`.
    pub fn next_u32(&mut self) -> u32 {
        self.state = self.state * MINSTD_A % MINSTD_M;
        self.state as u32
    }

    /// `std::generate_canonical<float, 24>`: one engine output scaled to `[0, 1)`.
    pub fn canonical(&mut self) -> f32 {
        let sum = (self.next_u32() - 1) as f32;
        // `tmp *= r`: 1.0f times 2147483646.0L, rounded to float (2^31).
        let tmp = 2_147_483_646.0f64 as f32;
        let ret = sum / tmp;
        if ret >= 1.0 {
            // nextafter(1.0f, 0.0f)
            f32::from_bits(1.0f32.to_bits() - 1)
        } else {
            ret
        }
    }
}

impl Rng for StdDefaultRng {
    fn manual_seed(&mut self, seed: u64) {
        let s = (seed as u32) as u64 % MINSTD_M;
        self.state = if s == 0 { 1 } else { s };
    }

    fn randn(&mut self, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n);
        let mut saved: Option<f32> = None;
        while out.len() < n {
            if let Some(v) = saved.take() {
                out.push(v * 1.0 + 0.0);
                continue;
            }
            let (x, y, r2) = loop {
                // `result_type(2.0) * u - 1.0`: the product in float, the difference in
                // double, stored as float.
                let x = ((2.0f32 * self.canonical()) as f64 - 1.0) as f32;
                let y = ((2.0f32 * self.canonical()) as f64 - 1.0) as f32;
                let r2 = x * x + y * y;
                if !(r2 > 1.0 || r2 == 0.0) {
                    break (x, y, r2);
                }
            };
            let mult = (-2.0f32 * r2.ln() / r2).sqrt();
            saved = Some(x * mult);
            out.push(y * mult * 1.0 + 0.0);
        }
        out
    }
}
