//! bf16 matrix products on Intel AMX tiles (`tdpbf16ps`), for the CPU kernels of this
//! crate when a graph's weights are bf16 (`sd --type bf16`) and the CPU has AMX-BF16
//! (Sapphire Rapids and later Xeons).
//!
//! **Why our own.** ggml's AMX path takes int8-quantized weights only (q8_0, q4_K, ...), and
//! in the ggml release this project builds it faults on GCC builds: the tile configuration
//! it keeps on the stack is optimised away before `ldtilecfg` reads it (upstream pull
//! request 26954, open). A bf16 tile product needs no quantization of the activations and
//! runs 16 bf16 products per f32 lane and cycle where AVX512-BF16 runs 2.
//!
//! **The product.** `C = A B` with `A` the weight, `M` rows of `K` bf16 values (`K` a
//! multiple of 32, rows `lda` bytes apart: a linear weight or a convolution kernel as
//! ggml stores them), `B` the activations packed by the caller as `[K / 2][32]` words per
//! block of 32 columns (a word holds the bf16 values `2p` and `2p + 1` of one column: the
//! tiles' VNNI layout), `C` f32. Each call of [`Blocks::run`] computes `32 x 32` blocks of `C`
//! on eight tiles: `A` rows in `tmm2`/`tmm3`, `B` columns in `tmm0`/`tmm1`, the four
//! accumulators in `tmm4`-`tmm7`; the caller writes each finished block where it belongs.
//! The sums are f32 (the tiles accumulate pairs of bf16 products in f32).
//!
//! **Users.** Linear layers ([`linear`]: the tokens or the weight as `A`, by the feature
//! count), convolutions (stride 1 over wide images and 1x1: [`implicit_conv_kernel`], no
//! im2col; else the bf16 im2col and [`conv_kernel`]) and the attention
//! (`host_attention.rs`, with [`Blocks::run_to`]).
//!
//! Tiles are used through `asm!` (Rust's AMX intrinsics are not stable). The tile state is
//! the calling thread's: every kernel configures it on entry ([`Blocks::new`]) and releases
//! it when done (its `Drop`).

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::asm;
use std::sync::OnceLock;

/// Rows and columns of one output block.
pub(crate) const BLOCK: usize = 32;

/// Whether this CPU and OS run AMX-BF16 tiles (asked once; `SD_AMX=0` turns them off).
pub(crate) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| std::env::var("SD_AMX").map_or(true, |v| v != "0") && detect())
}

fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    let (max, leaf7) = (__cpuid(0).eax, __cpuid_count(7, 0));
    if max < 7 {
        return false;
    }
    let amx_bf16 = leaf7.edx >> 22 & 1 == 1;
    let amx_tile = leaf7.edx >> 24 & 1 == 1;
    if !(amx_bf16 && amx_tile && std::arch::is_x86_feature_detected!("avx512f")) {
        return false;
    }
    // Linux keeps the tile data state off until the process asks for it
    // (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the answer covers every thread.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

/// `ldtilecfg`'s 64-byte operand (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

/// A configured tile state: eight tiles of 16 rows x 64 bytes. Released on drop.
pub(crate) struct Blocks(());

macro_rules! tile_load {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tileloadd tmm", $t, ", [{p} + {s}]"),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, readonly, preserves_flags)
        )
    };
}

macro_rules! tile_store {
    ($t:literal, $ptr:expr, $stride:expr) => {
        asm!(
            concat!("tilestored [{p} + {s}], tmm", $t),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, preserves_flags)
        )
    };
}

macro_rules! tile_dot {
    ($c:literal, $a:literal, $b:literal) => {
        asm!(
            concat!("tdpbf16ps tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem, preserves_flags)
        )
    };
}

impl Blocks {
    /// Configures this thread's tiles.
    ///
    /// # Safety
    /// [`available`] returned true; no other tile state of this thread is live.
    pub(crate) unsafe fn new() -> Blocks {
        let cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
            rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
        };
        // The configuration is read from memory: `cfg` lives on this frame until after it.
        asm!(
            "ldtilecfg [{p}]",
            p = in(reg) &cfg as *const TileConfig,
            options(nostack, readonly, preserves_flags)
        );
        Blocks(())
    }

    /// One `32 x 32` block of `C = A B` into `c` (row-major, 32 f32 a row): `a` points at 32
    /// rows of `A` (`lda` bytes apart, `32 kb` bf16 values each), `b` at `16 kb` rows of 32
    /// packed words (`ldb` bytes apart; see the module doc).
    ///
    /// # Safety
    /// All 32 rows of `a` and all `16 kb` rows of `b` are readable for `64 kb` and 128 bytes.
    #[inline]
    pub(crate) unsafe fn run(
        &mut self,
        a: *const u8,
        lda: usize,
        b: *const u8,
        ldb: usize,
        kb: usize,
        c: &mut [f32; BLOCK * BLOCK],
    ) {
        self.run_to(a, lda, b, ldb, kb, c.as_mut_ptr(), BLOCK * 4);
    }

    /// [`run`](Self::run) with the block stored at `c`, its 32 rows `ldc` bytes apart.
    ///
    /// # Safety
    /// As [`run`](Self::run); 32 rows of 32 f32 at `c`, `ldc` bytes apart, are writable.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_to(
        &mut self,
        a: *const u8,
        lda: usize,
        b: *const u8,
        ldb: usize,
        kb: usize,
        c: *mut f32,
        ldc: usize,
    ) {
        self.zero();
        for i in 0..kb {
            self.step(a.add(64 * i), lda, b.add(16 * i * ldb), ldb);
        }
        self.store_to(c, ldc);
    }
}

impl Blocks {
    /// The top half of [`run_to`](Self::run_to): a `16 x 32` block of `C = A B` from 16 rows
    /// of `A`, on two accumulators (a product whose rows end 16 into a block of 32: the
    /// attention's value widths of 40 and 80 take 48 and 80 rows instead of 64 and 96).
    ///
    /// # Safety
    /// As [`run_to`](Self::run_to), for 16 rows of `a` and 16 rows of `c`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_half_to(
        &mut self,
        a: *const u8,
        lda: usize,
        b: *const u8,
        ldb: usize,
        kb: usize,
        c: *mut f32,
        ldc: usize,
    ) {
        asm!(
            "tilezero tmm4",
            "tilezero tmm6",
            options(nostack, nomem, preserves_flags)
        );
        for i in 0..kb {
            let (ai, bi) = (a.add(64 * i), b.add(16 * i * ldb));
            tile_load!("2", ai, lda);
            tile_load!("0", bi, ldb);
            tile_load!("1", bi.add(64), ldb);
            tile_dot!("4", "2", "0");
            tile_dot!("6", "2", "1");
        }
        let p = c as *mut u8;
        tile_store!("4", p, ldc);
        tile_store!("6", p.add(64), ldc);
    }
}

impl Blocks {
    /// Zeroes the four accumulators (the start of a block summed over several operand pairs
    /// with [`step`](Self::step)).
    #[inline]
    pub(crate) fn zero(&mut self) {
        // SAFETY: tiles configured by `new`.
        unsafe {
            asm!(
                "tilezero tmm4",
                "tilezero tmm5",
                "tilezero tmm6",
                "tilezero tmm7",
                options(nostack, nomem, preserves_flags)
            )
        };
    }

    /// Adds one 32-value step of `A B` to the accumulators: `a` at 32 rows of 32 bf16 values
    /// (`lda` bytes apart), `b` at 16 rows of 32 packed words (`ldb` bytes apart).
    ///
    /// # Safety
    /// Those rows are readable.
    #[inline]
    pub(crate) unsafe fn step(&mut self, a: *const u8, lda: usize, b: *const u8, ldb: usize) {
        tile_load!("2", a, lda);
        tile_load!("3", a.add(16 * lda), lda);
        tile_load!("0", b, ldb);
        tile_load!("1", b.add(64), ldb);
        tile_dot!("4", "2", "0");
        tile_dot!("5", "3", "0");
        tile_dot!("6", "2", "1");
        tile_dot!("7", "3", "1");
    }

    /// Stores the accumulators into `c` (32 rows of 32 f32).
    #[inline]
    pub(crate) fn store(&mut self, c: &mut [f32; BLOCK * BLOCK]) {
        // SAFETY: `c` holds 32 rows of 128 bytes.
        unsafe { self.store_to(c.as_mut_ptr(), BLOCK * 4) }
    }

    /// Stores the accumulators at `c`, 32 rows of 32 f32 `ldc` bytes apart.
    ///
    /// # Safety
    /// Those rows are writable.
    #[inline]
    unsafe fn store_to(&mut self, c: *mut f32, ldc: usize) {
        let p = c as *mut u8;
        tile_store!("4", p, ldc);
        tile_store!("6", p.add(64), ldc);
        tile_store!("5", p.add(16 * ldc), ldc);
        tile_store!("7", p.add(16 * ldc + 64), ldc);
    }
}

impl Blocks {
    /// `S^T = K Q^T` for one block of 32 queries held in four tiles: `q` points at the
    /// queries packed as 32 rows (two steps of 16) of 32 words (`ldq` bytes apart: pairs of
    /// head values of 32 queries), `k` at `keys` rows of 64 bf16 values (`ldk` bytes apart: a
    /// head of at most 64 values, zero past it), and each 16 keys' scores are stored at
    /// `s`, key `j`'s 32 f32 at `s + j ldc` bytes. The queries are loaded once for all the
    /// keys (two tiles a step) and each 16 keys take one tile load a step, where
    /// [`run_to`](Self::run_to) loads both operands for every 32 keys: half the loads for the
    /// same products. `keys` is a multiple of 16.
    ///
    /// # Safety
    /// Those rows are readable and writable as described; the tiles are configured.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn scores_to(
        &mut self,
        q: *const u8,
        ldq: usize,
        k: *const u8,
        ldk: usize,
        keys: usize,
        s: *mut f32,
        ldc: usize,
    ) {
        // tmm0/tmm1: the first step's query columns 0-15 and 16-31, tmm2/tmm3 the second's.
        tile_load!("0", q, ldq);
        tile_load!("1", q.add(64), ldq);
        tile_load!("2", q.add(16 * ldq), ldq);
        tile_load!("3", q.add(16 * ldq + 64), ldq);
        let s = s as *mut u8;
        for j0 in (0..keys).step_by(16) {
            let a = k.add(j0 * ldk);
            asm!(
                "tilezero tmm6",
                "tilezero tmm7",
                options(nostack, nomem, preserves_flags)
            );
            tile_load!("4", a, ldk);
            tile_load!("5", a.add(64), ldk);
            tile_dot!("6", "4", "0");
            tile_dot!("7", "4", "1");
            tile_dot!("6", "5", "2");
            tile_dot!("7", "5", "3");
            let c = s.add(j0 * ldc);
            tile_store!("6", c, ldc);
            tile_store!("7", c.add(64), ldc);
        }
    }
}

impl Drop for Blocks {
    fn drop(&mut self) {
        // SAFETY: this thread's tiles were configured by `new`.
        unsafe { asm!("tilerelease", options(nostack, nomem, preserves_flags)) };
    }
}

/// Packs up to 32 columns of f32 activations as the product's `B` operand: column `j` is
/// `col(j)` (`k` values; `k` even), packed as `dst[p * 32 + j] = (v[2p], v[2p + 1])`;
/// columns past `cols` and pairs past `k / 2` (up to `kp / 2`) are zero.
///
/// # Safety
/// Each `col(j)` for `j < cols` points at `k` readable f32 values; `row` holds at least `k`
/// values (scratch); `dst` holds `kp / 2 * 32` words, `kp >= k`.
pub(crate) unsafe fn pack_f32_columns(
    cols: usize,
    k: usize,
    kp: usize,
    col: impl Fn(usize) -> *const f32,
    row: &mut [u16],
    dst: &mut [u32],
) {
    let half = k / 2;
    dst[..kp / 2 * BLOCK].fill(0);
    // Each column rounded to bf16 in one vectorised pass (into `row`), then its pairs
    // stored 32 apart.
    let row = &mut row[..k];
    for j in 0..cols.min(BLOCK) {
        to_bf16_row(std::slice::from_raw_parts(col(j), k), row);
        for (p, w) in row.chunks_exact(2).take(half).enumerate() {
            dst[p * BLOCK + j] = w[0] as u32 | (w[1] as u32) << 16;
        }
    }
}

/// Packs up to 32 columns of bf16 activations (`col(j)` points at `k` bf16 values as
/// `u16` bits, `k` even) as [`pack_f32_columns`] does.
///
/// # Safety
/// As [`pack_f32_columns`], for `k` readable `u16` values a column.
pub(crate) unsafe fn pack_bf16_columns(
    cols: usize,
    k: usize,
    kp: usize,
    col: impl Fn(usize) -> *const u16,
    dst: &mut [u32],
) {
    let half = k / 2;
    dst[..kp / 2 * BLOCK].fill(0);
    for j in 0..cols.min(BLOCK) {
        let v = std::slice::from_raw_parts(col(j) as *const u32, half);
        for (p, w) in v.iter().enumerate() {
            dst[p * BLOCK + j] = *w;
        }
    }
}

/// Bytes of packed `B` columns a kernel keeps per panel (reused by every row block of the
/// weight): about half of a Sapphire Rapids core's 2 MiB L2.
const PANEL_BYTES: usize = 1 << 20;

/// Column blocks of `k` values packed at once (a panel of [`PANEL_BYTES`]).
fn panel_blocks(k: usize) -> usize {
    (PANEL_BYTES / (k / 2 * BLOCK * 4)).max(1)
}

/// Bytes of bf16 rows [`product`] converts from a q8_0 weight at once (a super-block of
/// rows, used for every column block it is given; a few times the L2).
const Q8_0_SUPER_BYTES: usize = 4 << 20;

/// Rows of a `k`-wide q8_0 weight converted at once: a multiple of 32, at least 32.
fn q8_0_super_rows(k: usize) -> usize {
    (Q8_0_SUPER_BYTES / (2 * k) / BLOCK).max(1) * BLOCK
}

/// Bytes of one q8_0 block (ggml's `block_q8_0`: an f16 scale, then 32 signed bytes).
const Q8_0_BLOCK_BYTES: usize = 34;

/// The weight of a tile product, read as rows of bf16 values: stored bf16 (used in place), or
/// q8_0 blocks (ggml's 8-bit weights: `sd --type q8_0`), converted to bf16 a few rows at a
/// time where they are used (each value `d q` rounded to bf16; the tiles have no int8 product
/// with per-block scales, and a converted block of rows is reused by every column block of a
/// panel, so the conversion costs about one part in the panel's columns of the product).
#[derive(Clone, Copy)]
pub(crate) enum WeightRows {
    /// bf16 values, rows contiguous.
    Bf16(*const u16),
    /// q8_0 blocks, rows contiguous (`k / 32` blocks a row).
    Q8_0(*const u8),
}

impl WeightRows {
    /// The rows of ggml tensor `w` (bf16 or q8_0, contiguous); `None` for another type.
    pub(crate) fn of(w: &ggml_sys::ggml_tensor) -> Option<WeightRows> {
        match w.type_ {
            ggml_sys::GGML_TYPE_BF16 => Some(WeightRows::Bf16(w.data as *const u16)),
            ggml_sys::GGML_TYPE_Q8_0 => Some(WeightRows::Q8_0(w.data as *const u8)),
            _ => None,
        }
    }

    /// Rows `r0..r0 + rows` (`k` values each) as bf16: a pointer into the weight, or into
    /// `buf` (at least `rows * k` values) where they are converted.
    ///
    /// # Safety
    /// The weight holds those rows.
    pub(crate) unsafe fn rows(
        &self,
        r0: usize,
        rows: usize,
        k: usize,
        buf: &mut [u16],
    ) -> *const u16 {
        match *self {
            WeightRows::Bf16(p) => p.add(r0 * k),
            WeightRows::Q8_0(p) => {
                let row_bytes = k / BLOCK * Q8_0_BLOCK_BYTES;
                let src = std::slice::from_raw_parts(p.add(r0 * row_bytes), rows * row_bytes);
                q8_0_to_bf16(src, &mut buf[..rows * k]);
                buf.as_ptr()
            }
        }
    }
}

/// q8_0 blocks (`src`, whole blocks) as bf16 values (`dst`, 32 a block): `d q` rounded to
/// nearest even, as [`to_bf16_row`] rounds.
pub(crate) fn q8_0_to_bf16(src: &[u8], dst: &mut [u16]) {
    // SAFETY: the tile products run only where `available` found AVX-512.
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        unsafe { q8_0_to_bf16_avx512(src, dst) };
        return;
    }
    for (b, d) in src
        .chunks_exact(Q8_0_BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let scale = half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
        let v: [f32; BLOCK] = std::array::from_fn(|i| scale * f32::from(b[2 + i] as i8));
        to_bf16_row(&v, d);
    }
}

/// [`q8_0_to_bf16`] in AVX-512 registers: 16 values a register (LLVM keeps the portable loop
/// at SSE width in the README's baseline build).
#[target_feature(enable = "avx512f")]
unsafe fn q8_0_to_bf16_avx512(src: &[u8], dst: &mut [u16]) {
    use std::arch::x86_64::*;
    let round = _mm512_set1_epi32(0x7fff);
    let one = _mm512_set1_epi32(1);
    for (b, d) in src
        .chunks_exact(Q8_0_BLOCK_BYTES)
        .zip(dst.chunks_exact_mut(BLOCK))
    {
        let scale = _mm512_set1_ps(half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32());
        for h in 0..2 {
            let q = _mm_loadu_si128(b.as_ptr().add(2 + 16 * h) as *const __m128i);
            let v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale);
            let u = _mm512_castps_si512(v);
            let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(u), one);
            let r = _mm512_srli_epi32::<16>(_mm512_add_epi32(u, _mm512_add_epi32(odd, round)));
            _mm256_storeu_si256(
                d.as_mut_ptr().add(16 * h) as *mut __m256i,
                _mm512_cvtepi32_epi16(r),
            );
        }
    }
}

/// Whether the tile products compute a product of this bf16 (or q8_0, see [`WeightRows`])
/// weight: `k` (the rows' length) and `m` (its rows) multiples of 32, contiguous rows; AMX
/// present.
pub(crate) fn covers(k: usize, m: usize, weight_bf16_contiguous: bool) -> bool {
    weight_bf16_contiguous
        && k > 0
        && m > 0
        && k.is_multiple_of(BLOCK)
        && m.is_multiple_of(BLOCK)
        && available()
}

/// Runs the product of rows `rows_of_a` of `weight` (rows of `k` values, contiguous; the
/// range in whole blocks of 32) with the column blocks `blocks` (32 columns each; `cols`
/// columns in all), packing each block with `pack(block, dst)` and handing every finished
/// `32 x 32` result to `write(row0, col0, ncols, c)` (`c[r * 32 + j]` is row `row0 + r`,
/// column `col0 + j`). The columns go in panels of [`PANEL_BYTES`] packed (kept in L2 for
/// every row block) unless `packed_all` holds the blocks packed already (block `b` at
/// `(b - blocks.start) * k / 2 * 32`); a q8_0 weight's rows are converted a super-block
/// at a time ([`q8_0_super_rows`]), each once, the panels packed again for each
/// super-block where `packed_all` is absent.
///
/// # Safety
/// `weight` holds the rows `rows_of_a` of `k` values; [`covers`] accepted `k` and the rows;
/// `pack` fills the `k / 2 * 32` words it is given.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    weight: WeightRows,
    k: usize,
    rows_of_a: std::ops::Range<usize>,
    cols: usize,
    blocks: std::ops::Range<usize>,
    packed_all: Option<&[u32]>,
    mut pack: impl FnMut(usize, &mut [u32]),
    mut write: impl FnMut(usize, usize, usize, &[f32; BLOCK * BLOCK]),
) {
    if blocks.is_empty() || rows_of_a.is_empty() {
        return;
    }
    let block_words = k / 2 * BLOCK;
    let panel = panel_blocks(k).min(blocks.len());
    let panel_words = if packed_all.is_some() {
        0
    } else {
        panel * block_words
    };
    // Rows converted at once: all of them for bf16 (used in place).
    let super_rows = match weight {
        WeightRows::Bf16(_) => rows_of_a.len(),
        WeightRows::Q8_0(_) => q8_0_super_rows(k).min(rows_of_a.len()),
    };
    let converted_words = match weight {
        WeightRows::Bf16(_) => 0,
        WeightRows::Q8_0(_) => super_rows * k / 2,
    };
    super::host_conv::with_scratch(panel_words + converted_words, |scratch| {
        // SAFETY: the scratch's f32 values reinterpreted as words of the same size.
        let scratch = std::slice::from_raw_parts_mut(
            scratch.as_mut_ptr() as *mut u32,
            panel_words + converted_words,
        );
        let (packed, converted) = scratch.split_at_mut(panel_words);
        let converted =
            std::slice::from_raw_parts_mut(converted.as_mut_ptr() as *mut u16, converted_words * 2);
        let mut tiles = Blocks::new();
        let mut c = [0f32; BLOCK * BLOCK];
        for s0 in rows_of_a.clone().step_by(super_rows) {
            let s1 = (s0 + super_rows).min(rows_of_a.end);
            let a0 = weight.rows(s0, s1 - s0, k, converted);
            let mut b0 = blocks.start;
            while b0 < blocks.end {
                let b1 = (b0 + panel).min(blocks.end);
                // The panel's packed blocks: packed here, or where `packed_all` has them.
                let (panel_of, first) = match packed_all {
                    Some(all) => (all, b0 - blocks.start),
                    None => {
                        for (i, b) in (b0..b1).enumerate() {
                            pack(b, &mut packed[i * block_words..(i + 1) * block_words]);
                        }
                        (&*packed, 0)
                    }
                };
                for row0 in (s0..s1).step_by(BLOCK) {
                    let a = a0.add((row0 - s0) * k) as *const u8;
                    for (i, b) in (b0..b1).enumerate() {
                        let bp = panel_of[(first + i) * block_words..].as_ptr() as *const u8;
                        tiles.run(a, k * 2, bp, BLOCK * 4, k / BLOCK, &mut c);
                        let col0 = b * BLOCK;
                        write(row0, col0, (cols - col0).min(BLOCK), &c);
                    }
                }
                b0 = b1;
            }
        }
    });
}

/// f32 values as bf16 bits, rounded to nearest even, NaN kept a (quiet) NaN: ggml's
/// rounding, in a form the compiler vectorises.
#[inline]
pub(crate) fn to_bf16_row(src: &[f32], dst: &mut [u16]) {
    for (d, s) in dst.iter_mut().zip(src) {
        let u = s.to_bits();
        let rounded = (u.wrapping_add(0x7fff + (u >> 16 & 1)) >> 16) as u16;
        let nan = ((u >> 16) | 64) as u16;
        *d = if u & 0x7fff_ffff > 0x7f80_0000 {
            nan
        } else {
            rounded
        };
    }
}

/// Output features below which [`linear`] makes the tokens the product's `A`
/// ([`linear_token_rows`]) rather than the weight ([`linear_weight_rows`]): on a 2-core
/// Sapphire Rapids slice, `320 -> 320` over 8192 tokens ran at 539 against 354 GFLOP/s,
/// `1280 -> 320` 581 against 410, `2560 -> 640` over 2048 639 against 755, `640 -> 5120`
/// 576 against 993 (`examples/amx_probe.rs`).
pub(crate) const TOKEN_ROWS_BELOW: usize = 512;

/// The linear layer's custom op on tiles (see `host_linear.rs` for the sources and the
/// output): the threads take chunks of the work (blocks of 32 tokens, or of a q8_0
/// weight's rows) as they ask for them (`host_conv::claim_chunks`), so that a faster core
/// takes more.
///
/// # Safety
/// As `host_linear::linear_kernel`, with a bf16 weight [`covers`] accepted.
pub(crate) unsafe fn linear(
    dst: &ggml_sys::ggml_tensor,
    x: &ggml_sys::ggml_tensor,
    w: &ggml_sys::ggml_tensor,
    bias: Option<&[f32]>,
    nth: usize,
) {
    if (w.ne[1] as usize) < TOKEN_ROWS_BELOW {
        linear_token_rows(dst, x, w, bias, nth);
    } else {
        linear_weight_rows(dst, x, w, bias, nth);
    }
}

/// [`linear`] with the weight as the product's `A` (its rows as stored, no packing) and the
/// tokens as `B` (packed a block of 32 at a time); results written transposed.
///
/// # Safety
/// As [`linear`].
unsafe fn linear_weight_rows(
    dst: &ggml_sys::ggml_tensor,
    x: &ggml_sys::ggml_tensor,
    w: &ggml_sys::ggml_tensor,
    bias: Option<&[f32]>,
    nth: usize,
) {
    let (k, m) = (w.ne[0] as usize, w.ne[1] as usize);
    let n = (x.ne[1] * x.ne[2] * x.ne[3]) as usize;
    let Some(weight) = WeightRows::of(w) else {
        return;
    };
    // Threads take chunks of the tokens (at most a panel's worth), each running every
    // weight row: as stored (bf16), or converted for each panel (q8_0). Where a q8_0
    // weight would be converted too often that way (fewer tokens than features, or panels
    // of fewer than 256 tokens: `k` past 2048, FLUX's and SDXL's wide layers), they take
    // chunks of its rows instead (each super-block converted once), every token packed by
    // each thread beforehand, in groups of at most `PACKED_TOKENS_BYTES` in all.
    let col_blocks = n.div_ceil(BLOCK);
    let nth = nth.max(1);
    let by_rows = matches!(weight, WeightRows::Q8_0(_)) && (n < m || k > ROWS_PAST_K);
    let (xd, out) = (x.data as *const f32, dst.data as *mut f32);
    let mut row = vec![0u16; k];
    let mut pack = |b: usize, dst: &mut [u32]| {
        let col0 = b * BLOCK;
        let cols = (n - col0).min(BLOCK);
        pack_f32_columns(cols, k, k, |j| xd.add((col0 + j) * k), &mut row, dst)
    };
    let mut write = |row0: usize, col0: usize, ncols: usize, c: &[f32; BLOCK * BLOCK]| {
        for j in 0..ncols {
            let o = std::slice::from_raw_parts_mut(out.add((col0 + j) * m + row0), BLOCK);
            for (r, v) in o.iter_mut().enumerate() {
                *v = c[r * BLOCK + j] + bias.map_or(0.0, |b| b[row0 + r]);
            }
        }
    };
    let key = dst as *const _ as usize;
    if !by_rows {
        // At least three chunks a thread, so that a faster core can take more.
        let grain = panel_blocks(k).min(col_blocks.div_ceil(3 * nth)).max(1);
        super::host_conv::claim_chunks(key, nth as _, col_blocks, grain, |blocks| {
            product(weight, k, 0..m, n, blocks, None, &mut pack, &mut write)
        });
        return;
    }
    let per_thread = (PACKED_TOKENS_BYTES / nth).max(4 << 20);
    by_rows_in_groups(weight, k, m, n, nth, key, per_thread, pack, write);
}

/// The product of `weight` (`m` rows of `k`) with `n` tokens by rows: the tokens packed
/// (`pack(block, dst)`) by each thread in groups of at most `per_thread` bytes, and for each
/// group the threads claiming super-blocks of rows (under `key`, as [`claim_chunks`]),
/// each converted once; `write` as [`product`]'s.
///
/// [`claim_chunks`]: super::host_conv::claim_chunks
///
/// # Safety
/// As [`product`] for the rows `0..m`.
#[allow(clippy::too_many_arguments)]
unsafe fn by_rows_in_groups(
    weight: WeightRows,
    k: usize,
    m: usize,
    n: usize,
    nth: usize,
    key: usize,
    per_thread: usize,
    mut pack: impl FnMut(usize, &mut [u32]),
    mut write: impl FnMut(usize, usize, usize, &[f32; BLOCK * BLOCK]),
) {
    let col_blocks = n.div_ceil(BLOCK);
    let block_words = k / 2 * BLOCK;
    let group = (per_thread / (block_words * 4)).clamp(1, col_blocks);
    let row_blocks = m / BLOCK;
    let grain = (q8_0_super_rows(k) / BLOCK)
        .min(row_blocks.div_ceil(3 * nth))
        .max(1);
    PACKED_TOKENS.with_borrow_mut(|all| {
        if all.len() < group * block_words {
            all.resize(group * block_words, 0);
        }
        // Every thread goes through the groups in order; each group is one `claim_chunks`
        // call under a key of its own (the op's key with the group's number in the bits
        // above any address): a thread done with one group's chunks before another thread
        // has arrived there must not join that group's counter for the next group.
        for (gi, g0) in (0..col_blocks).step_by(group).enumerate() {
            let group_key = key ^ (gi << 48);
            let g1 = (g0 + group).min(col_blocks);
            for b in g0..g1 {
                let i = b - g0;
                pack(b, &mut all[i * block_words..(i + 1) * block_words]);
            }
            let packed = &all[..(g1 - g0) * block_words];
            super::host_conv::claim_chunks(group_key, nth as _, row_blocks, grain, |r| {
                let rows = r.start * BLOCK..r.end * BLOCK;
                product(
                    weight,
                    k,
                    rows,
                    n,
                    g0..g1,
                    Some(packed),
                    |_, _| {},
                    &mut write,
                )
            });
        }
    });
}

/// The width past which a q8_0 product goes by rows (see [`linear_weight_rows`]): a panel
/// of tokens at this width is 256 tokens, so converting the weight for each panel costs
/// one value a 512 tile operations.
const ROWS_PAST_K: usize = 2048;

/// The bytes of packed tokens the threads of one q8_0 product by rows keep in all
/// (divided among them, at least 4 MiB each): FLUX's 1536 tokens at 512x512 are 9 MiB for
/// its 3072-wide layers, 45 MiB for the 15360-wide `linear2`; past a thread's share the
/// tokens go in groups, each weight row converted once a group.
const PACKED_TOKENS_BYTES: usize = 128 << 20;

std::thread_local! {
    /// The tokens of a q8_0 product packed (see [`PACKED_TOKENS_BYTES`]).
    static PACKED_TOKENS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`linear`] with the tokens as the product's `A` (rows of `K` values, rounded to bf16 a
/// chunk at a time) and the weight as its `B`, packed once a call by each thread: each
/// output row (one token's features) is written as stored, contiguous.
///
/// # Safety
/// As [`linear`].
unsafe fn linear_token_rows(
    dst: &ggml_sys::ggml_tensor,
    x: &ggml_sys::ggml_tensor,
    w: &ggml_sys::ggml_tensor,
    bias: Option<&[f32]>,
    nth: usize,
) {
    let (k, m) = (w.ne[0] as usize, w.ne[1] as usize);
    let n = (x.ne[1] * x.ne[2] * x.ne[3]) as usize;
    let (xd, out) = (x.data as *const f32, dst.data as *mut f32);
    let Some(weight) = WeightRows::of(w) else {
        return;
    };
    let key = dst as *const _ as usize;
    token_rows(
        weight,
        k,
        m,
        n,
        |f| {
            // At most `token_chunk` blocks, at least three chunks a thread.
            let blocks = n.div_ceil(BLOCK);
            let grain = token_chunk(k).min(blocks.div_ceil(3 * nth.max(1))).max(1);
            super::host_conv::claim_chunks(key, nth as _, blocks, grain, f)
        },
        |t, d| to_bf16_row(std::slice::from_raw_parts(xd.add(t * k), k), d),
        |t, col0, c| {
            let o = std::slice::from_raw_parts_mut(out.add(t * m + col0), BLOCK);
            match bias {
                Some(b) => {
                    for ((v, x), b) in o.iter_mut().zip(c).zip(&b[col0..col0 + BLOCK]) {
                        *v = x + b;
                    }
                }
                None => o.copy_from_slice(c),
            }
        },
    );
}

/// The product `rows x weight^T` with the rows (`n` of them, `k` values each) as the tiles'
/// `A` and the weight (`m` rows of `k` values, as `k / 2` words of bf16 pairs each) as `B`,
/// packed (a q8_0 weight converted) once a call by each thread. `row(t, dst)` writes row `t`
/// as bf16; `write(t, col0, c)` takes the 32 results of row `t`, columns `col0..col0 + 32`.
/// `claim(f)` calls `f` with each range of 32-row blocks this thread is to compute, at most
/// [`token_chunk`]`(k)` blocks each (about 512 KiB of rows, converted at once).
///
/// # Safety
/// `weight` holds `m` rows of `k` values; [`covers`] accepted `k`, `m`.
unsafe fn token_rows(
    weight: WeightRows,
    k: usize,
    m: usize,
    n: usize,
    claim: impl FnOnce(&mut dyn FnMut(std::ops::Range<usize>)),
    row: impl Fn(usize, &mut [u16]),
    mut write: impl FnMut(usize, usize, &[f32]),
) {
    let chunk = token_chunk(k);
    let (wwords, awords) = (k / 2 * m, chunk * BLOCK * k / 2);
    super::host_conv::with_scratch(wwords + awords, |scratch| {
        // SAFETY: the scratch's f32 values reinterpreted as words of the same size.
        let scratch =
            std::slice::from_raw_parts_mut(scratch.as_mut_ptr() as *mut u32, wwords + awords);
        let (packed, rows) = scratch.split_at_mut(wwords);
        // B: word p of weight row j (its bf16 values 2p, 2p + 1) at p * m + j.
        let mut converted = match weight {
            WeightRows::Bf16(_) => Vec::new(),
            WeightRows::Q8_0(_) => vec![0u16; k],
        };
        for j in 0..m {
            let wr = std::slice::from_raw_parts(
                weight.rows(j, 1, k, &mut converted) as *const u32,
                k / 2,
            );
            for (p, v) in wr.iter().enumerate() {
                packed[p * m + j] = *v;
            }
        }
        let rows = std::slice::from_raw_parts_mut(rows.as_mut_ptr() as *mut u16, awords * 2);
        let mut tiles = Blocks::new();
        let mut c = [0f32; BLOCK * BLOCK];
        claim(&mut |blocks| {
            let (b0, b1) = (blocks.start, blocks.end.min(blocks.start + chunk));
            let (t0, t1) = (b0 * BLOCK, (b1 * BLOCK).min(n));
            for t in t0..b1 * BLOCK {
                let d = &mut rows[(t - t0) * k..(t - t0 + 1) * k];
                if t < t1 {
                    row(t, d);
                } else {
                    d.fill(0);
                }
            }
            for col0 in (0..m).step_by(BLOCK) {
                let bp = packed.as_ptr().add(col0) as *const u8;
                for tb in (t0..t1).step_by(BLOCK) {
                    let a = rows.as_ptr().add((tb - t0) * k) as *const u8;
                    tiles.run(a, k * 2, bp, m * 4, k / BLOCK, &mut c);
                    for r in 0..(t1 - tb).min(BLOCK) {
                        write(tb + r, col0, &c[r * BLOCK..(r + 1) * BLOCK]);
                    }
                }
            }
        });
    });
}

/// Blocks of 32 rows of `k` values [`token_rows`] converts at once (about 512 KiB of bf16).
fn token_chunk(k: usize) -> usize {
    ((1usize << 18) / k).max(1)
}

/// A convolution's product and epilogue on tiles, as one custom op: `src[0]` the bf16
/// im2col `[K, OW, OH, N]` (this crate's im2col), `src[1]` the bf16 kernel `[KW, KH, IC, OC]`
/// (contiguous, `K = KW KH IC`), `src[2]` the bias `[OC]` f32 or absent; `dst`
/// `[OW, OH, OC, N]` f32. Thread `ith` of `nth` takes a share of (image, block of 32 pixels).
///
/// # Safety
/// Called by ggml on a `dst` built by `Context::conv_2d_host` after [`covers`] accepted
/// `K` and `OC` of a contiguous bf16 kernel.
pub(crate) unsafe extern "C" fn conv_kernel(
    dst: *mut ggml_sys::ggml_tensor,
    ith: std::ffi::c_int,
    nth: std::ffi::c_int,
    _userdata: *mut std::ffi::c_void,
) {
    let (d, im, w) = (&*dst, &*(*dst).src[0], &*(*dst).src[1]);
    let (k, oc) = (im.ne[0] as usize, w.ne[3] as usize);
    let p = (im.ne[1] * im.ne[2]) as usize;
    let images = im.ne[3] as usize;
    let bias = (*dst).src[2]
        .as_ref()
        .map(|b| std::slice::from_raw_parts(b.data as *const f32, oc));
    let (imd, out) = (im.data as *const u16, d.data as *mut f32);
    let per_image = p.div_ceil(BLOCK);
    let items = super::host_conv::thread_share(images * per_image, ith, nth);
    // Items of one image at a time: the product's columns are that image's pixels.
    let mut i0 = items.start;
    while i0 < items.end {
        let img = i0 / per_image;
        let i1 = items.end.min((img + 1) * per_image);
        let base = imd.add(img * p * k);
        let out_img = out.add(img * oc * p);
        product(
            WeightRows::Bf16(w.data as *const u16),
            k,
            0..oc,
            p,
            i0 - img * per_image..i1 - img * per_image,
            None,
            |b, dst| {
                let col0 = b * BLOCK;
                pack_bf16_columns(
                    (p - col0).min(BLOCK),
                    k,
                    k,
                    |j| base.add((col0 + j) * k),
                    dst,
                )
            },
            |row0, col0, ncols, c| {
                for r in 0..BLOCK {
                    let o =
                        std::slice::from_raw_parts_mut(out_img.add((row0 + r) * p + col0), ncols);
                    let add = bias.map_or(0.0, |b| b[row0 + r]);
                    for (j, v) in o.iter_mut().enumerate() {
                        *v = c[r * BLOCK + j] + add;
                    }
                }
            },
        );
        i0 = i1;
    }
}

/// Bytes of one item's packed input rows (the tiles' `B` of an implicit convolution).
const IMPLICIT_INPUT_BYTES: usize = 2 << 20;

/// Padded columns per wasted column at least (as `host_conv_implicit.rs`): the `KW - 1`
/// columns of each padded row that are not output pixels stay within 1/32 of the work.
const IMPLICIT_MAX_WASTE: usize = 32;

/// Whether [`implicit_conv_kernel`] computes a convolution: bf16 kernel `[KW, KH, C, OC]`
/// (contiguous) with `OC` a multiple of 32, input `[W, H, C, N]` f32 with contiguous rows,
/// stride and dilation 1, images wide enough that the padded rows' spare columns stay
/// within 1/32 of the work; AMX present.
pub(crate) fn covers_implicit(
    kernel_ne: [usize; 4],
    input_ne: [usize; 4],
    geometry: super::host_conv::Im2colGeometry,
) -> bool {
    let unit = geometry.stride == [1, 1] && geometry.dilation == [1, 1];
    let padded_width = input_ne[0] + 2 * geometry.pad[0] as usize;
    unit && kernel_ne[2] == input_ne[2]
        && kernel_ne[3].is_multiple_of(BLOCK)
        && (kernel_ne[0] - 1) * IMPLICIT_MAX_WASTE <= padded_width
        && geometry.output_size(input_ne[0], input_ne[1]).is_some()
        && available()
}

/// A stride-1 convolution of a bf16 kernel on tiles with no im2col (the scheme of
/// `host_conv_implicit.rs`): in the padded grid (`PW = W + 2 px` columns) output pixel
/// `q = y PW + x` of tap `(ky, kx)` reads input value `q + ky PW + kx`, so each tap is a
/// tile product of the kernel's tap slice (`[OC][C]`, the tiles' `A`) with the padded input
/// as pairs of channels (`[C / 2][rows * PW]` words, the tiles' `B`) read at the tap's
/// offset; the accumulators sum every tap and channel step before one store. Sources and
/// output as the im2col tile op's, but `src[0]` is the f32 input `[W, H, C, N]` (contiguous
/// rows). Items are (image, block of output rows); each thread packs the kernel tap-major
/// once a call and each item's padded rows (about 2 MiB), then writes the output pixels
/// (not the spare columns) with the bias.
///
/// # Safety
/// Called by ggml on a `dst` built by `Context::conv_2d_host` after [`covers_implicit`]
/// accepted it; `userdata` the packed geometry.
pub(crate) unsafe extern "C" fn implicit_conv_kernel(
    dst: *mut ggml_sys::ggml_tensor,
    ith: std::ffi::c_int,
    nth: std::ffi::c_int,
    userdata: *mut std::ffi::c_void,
) {
    let g = super::host_conv::Im2colGeometry::unpack(userdata as usize);
    let (d, x, w) = (&*dst, &*(*dst).src[0], &*(*dst).src[1]);
    let bias = (*dst).src[2]
        .as_ref()
        .map(|b| std::slice::from_raw_parts(b.data as *const f32, w.ne[3] as usize));
    let [iw, ih, c, n] = x.ne.map(|v| v as usize);
    let (kw, kh, oc) = (w.ne[0] as usize, w.ne[1] as usize, w.ne[3] as usize);
    let (px, py) = (g.pad[0] as usize, g.pad[1] as usize);
    let pw = iw + 2 * px;
    let (ow, oh) = (d.ne[0] as usize, d.ne[1] as usize);
    let cp = c.next_multiple_of(BLOCK);
    // Output rows an item: its packed rows (plus the taps' reach) near IMPLICIT_INPUT_BYTES.
    let fit = (IMPLICIT_INPUT_BYTES / (cp * 2 * pw))
        .saturating_sub(kh)
        .max(1);
    let blocks = oh.div_ceil(fit.min(oh));
    let rows = oh.div_ceil(blocks);
    let items = super::host_conv::thread_share(n * blocks, ith, nth);
    if items.is_empty() {
        return;
    }
    // Words of one channel pair's plane: the block's padded rows, the taps' reach past the
    // last output pixel and a spare column block.
    let plane = (rows + kh) * pw + BLOCK;
    // A 1x1 kernel of whole channel blocks is the tiles' `A` as stored (rows of `c`).
    let direct = kh * kw == 1 && c == cp;
    let kwords = if direct { 0 } else { kh * kw * oc * cp / 2 };
    let bwords = cp / 2 * plane;
    let (xs, kd) = (x.data as *const u8, w.data as *const u16);
    let (nb1, nb2, nb3) = (x.nb[1], x.nb[2], x.nb[3]);
    let out = d.data as *mut f32;
    super::host_conv::with_scratch(kwords + bwords, |scratch| {
        // SAFETY: the scratch's f32 values reinterpreted as words of the same size.
        let scratch =
            std::slice::from_raw_parts_mut(scratch.as_mut_ptr() as *mut u32, kwords + bwords);
        let (kt, bp) = scratch.split_at_mut(kwords);
        // A: tap t's slice as rows of `cp` bf16 values: kt16[(t * oc + o) * cp + ch].
        let kt16 = std::slice::from_raw_parts_mut(kt.as_mut_ptr() as *mut u16, kwords * 2);
        kt16.fill(0);
        for o in (0..oc).filter(|_| !direct) {
            for ch in 0..c {
                let src = kd.add((o * c + ch) * kh * kw);
                for t in 0..kh * kw {
                    kt16[(t * oc + o) * cp + ch] = *src.add(t);
                }
            }
        }
        let mut tiles = Blocks::new();
        let mut cblock = [0f32; BLOCK * BLOCK];
        // One input row of the two channels of a pair, as bf16.
        let (mut lo, mut hi) = (vec![0u16; iw], vec![0u16; iw]);
        for item in items {
            let (img, blk) = (item / blocks, item % blocks);
            let y0 = blk * rows;
            let y1 = (y0 + rows).min(oh);
            // B: padded input rows y0 .. y1 + kh - 1 (padded coordinates), channel pairs.
            bp.fill(0);
            for pr in 0..c.div_ceil(2) {
                for r in 0..(y1 - y0 + kh - 1) {
                    let iy = (y0 + r) as isize - py as isize;
                    if iy < 0 || iy >= ih as isize {
                        continue;
                    }
                    let row = |ch: usize| {
                        std::slice::from_raw_parts(
                            xs.add(img * nb3 + ch * nb2 + iy as usize * nb1) as *const f32,
                            iw,
                        )
                    };
                    to_bf16_row(row(2 * pr), &mut lo);
                    if 2 * pr + 1 < c {
                        to_bf16_row(row(2 * pr + 1), &mut hi);
                    } else {
                        hi.fill(0);
                    }
                    let dst = &mut bp[pr * plane + r * pw + px..][..iw];
                    for ((v, l), h) in dst.iter_mut().zip(&lo).zip(&hi) {
                        *v = *l as u32 | (*h as u32) << 16;
                    }
                }
            }
            let q_end = (y1 - y0) * pw;
            for o0 in (0..oc).step_by(BLOCK) {
                for q0 in (0..q_end).step_by(BLOCK) {
                    tiles.zero();
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let t = ky * kw + kx;
                            let a = if direct {
                                kd.add(o0 * cp) as *const u8
                            } else {
                                kt16.as_ptr().add((t * oc + o0) * cp) as *const u8
                            };
                            let b = bp.as_ptr().add(q0 + ky * pw + kx) as *const u8;
                            for s in 0..cp / BLOCK {
                                tiles.step(
                                    a.add(s * 64),
                                    cp * 2,
                                    b.add(s * 16 * plane * 4),
                                    plane * 4,
                                );
                            }
                        }
                    }
                    tiles.store(&mut cblock);
                    for r in 0..BLOCK {
                        let o = o0 + r;
                        let add = bias.map_or(0.0, |b| b[o]);
                        let plane_out = out.add((img * oc + o) * oh * ow);
                        for j in 0..BLOCK.min(q_end - q0) {
                            let q = q0 + j;
                            let (y, xx) = (q / pw, q % pw);
                            if xx < ow {
                                *plane_out.add((y0 + y) * ow + xx) = cblock[r * BLOCK + j] + add;
                            }
                        }
                    }
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(i: usize, seed: usize) -> f32 {
        ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) % 1000) as f32 / 500.0 - 1.0
    }

    /// q8_0 blocks of `rows` rows of `k` values (`k` a multiple of 32): a scale and 32 small
    /// integers a block, with the values they stand for (rounded to bf16, as the tiles read them).
    fn q8_0_rows(rows: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
        let (mut bytes, mut values) = (Vec::new(), Vec::new());
        for blk in 0..rows * k / BLOCK {
            let d = half::f16::from_f32(0.01 + 0.001 * (blk % 7) as f32);
            bytes.extend_from_slice(&d.to_bits().to_le_bytes());
            for i in 0..BLOCK {
                let q = ((blk * 31 + i * 17) % 255) as i32 - 127;
                bytes.push(q as i8 as u8);
                values.push(half::bf16::from_f32(d.to_f32() * q as f32).to_f32());
            }
        }
        (bytes, values)
    }

    /// One thread's part of a q8_0 product by rows of the weight at `q` (`m` rows of `k`)
    /// with the `n` tokens of `x`, written transposed at `out` (`n` rows of `m`): groups of
    /// two packed blocks, `nth` threads under `key`; `hold` sleeps before the first packing.
    ///
    /// # Safety
    /// AMX present; `q` holds `m` rows of `k` q8_0 values; `out` holds `n * m` f32, the
    /// other threads of the call writing other chunks of it.
    #[allow(clippy::too_many_arguments)]
    unsafe fn by_rows_part(
        q: *const u8,
        x: &[f32],
        out: *mut f32,
        (m, k, n): (usize, usize, usize),
        nth: usize,
        key: usize,
        hold: bool,
    ) {
        let block_words = k / 2 * BLOCK;
        let mut row = vec![0u16; k];
        let mut first = hold;
        by_rows_in_groups(
            WeightRows::Q8_0(q),
            k,
            m,
            n,
            nth,
            key,
            2 * block_words * 4,
            |b, dst| {
                if std::mem::take(&mut first) {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                let col0 = b * BLOCK;
                let cols = (n - col0).min(BLOCK);
                pack_f32_columns(cols, k, k, |j| x[(col0 + j) * k..].as_ptr(), &mut row, dst)
            },
            |row0, col0, ncols, c| {
                for j in 0..ncols {
                    for r in 0..BLOCK {
                        *out.add((col0 + j) * m + row0 + r) = c[r * BLOCK + j];
                    }
                }
            },
        );
    }

    /// `out` (`n` rows of `m`) is `x` (`n` rows of `k`, rounded to bf16) times the weight
    /// values `w` (`m` rows of `k`), to f32 summation's error.
    fn assert_product(out: &[f32], w: &[f32], x: &[f32], (m, k, n): (usize, usize, usize)) {
        let round = |v: f32| half::bf16::from_f32(v).to_f32() as f64;
        for t in 0..n {
            for r in 0..m {
                let want: f64 = (0..k)
                    .map(|i| w[r * k + i] as f64 * round(x[t * k + i]))
                    .sum();
                let got = out[t * m + r] as f64;
                assert!(
                    (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "token {t}, row {r}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn q8_0_by_rows_in_token_groups_equals_the_product() {
        if !available() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        // 96 rows of 64, 200 tokens (7 blocks, the last partial) in groups of 2 blocks
        // (the bytes of two packed blocks): four groups, each weight row converted in each.
        let dims = (96, 64, 200);
        let (m, k, n) = dims;
        let (q, w) = q8_0_rows(m, k);
        let x: Vec<f32> = (0..n * k).map(|i| value(i, 3)).collect();
        let mut out = vec![f32::NAN; n * m];
        // SAFETY: AMX present; q holds m rows of k q8_0 values, out n * m values.
        unsafe { by_rows_part(q.as_ptr(), &x, out.as_mut_ptr(), dims, 1, 0xC000, false) };
        assert_product(&out, &w, &x, dims);
    }

    /// Two threads of one product by rows, the second held up in its first packing until
    /// the first has claimed every chunk of the first group: each group's chunks are still
    /// computed once, with that group's tokens (a thread must not take the next group's
    /// work from the counter of a group another thread has not reached).
    #[test]
    fn a_thread_late_to_a_group_leaves_the_next_group_whole() {
        if !available() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        let dims = (96, 64, 200);
        let (m, k, n) = dims;
        let (q, w) = q8_0_rows(m, k);
        let x: Vec<f32> = (0..n * k).map(|i| value(i, 5)).collect();
        let mut out = vec![f32::NAN; n * m];
        let (qp, op) = (q.as_ptr() as usize, out.as_mut_ptr() as usize);
        std::thread::scope(|s| {
            for t in 0..2 {
                let x = &x;
                // SAFETY: as above; the threads write disjoint chunks of out, which
                // outlives the scope.
                s.spawn(move || unsafe {
                    by_rows_part(qp as _, x, op as _, dims, 2, 0xD000, t == 1)
                });
            }
        });
        assert_product(&out, &w, &x, dims);
    }

    #[test]
    fn tile_blocks_equal_the_bf16_product() {
        if !available() {
            eprintln!("skipped: no AMX-BF16 on this CPU");
            return;
        }
        let (m, k) = (32, 96);
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        let a: Vec<u16> = (0..m * k)
            .map(|i| half::bf16::from_f32(value(i, 1)).to_bits())
            .collect();
        let cols: Vec<Vec<f32>> = (0..20)
            .map(|j| (0..k).map(|i| value(i + 1000 * j, 2)).collect())
            .collect();
        let mut b = vec![0u32; k / 2 * BLOCK];
        // SAFETY: 20 columns of k values; b holds k/2 * 32 words.
        unsafe {
            pack_f32_columns(
                cols.len(),
                k,
                k,
                |j| cols[j].as_ptr(),
                &mut vec![0; k],
                &mut b,
            )
        };
        let mut c = [0f32; BLOCK * BLOCK];
        // SAFETY: AMX present; a has 32 rows of k values, b k/2 rows of 32 words.
        unsafe {
            let mut t = Blocks::new();
            t.run(
                a.as_ptr() as *const u8,
                k * 2,
                b.as_ptr() as *const u8,
                128,
                k / 32,
                &mut c,
            );
        }
        for r in 0..m {
            for j in 0..BLOCK {
                let want: f64 = if j < cols.len() {
                    (0..k)
                        .map(|i| {
                            half::bf16::from_bits(a[r * k + i]).to_f32() as f64
                                * round(cols[j][i]) as f64
                        })
                        .sum()
                } else {
                    0.0
                };
                let got = c[r * BLOCK + j] as f64;
                assert!(
                    (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "({r}, {j}): {got} vs {want}"
                );
            }
        }
    }
}
