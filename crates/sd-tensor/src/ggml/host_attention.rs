//! A CPU kernel of this crate, run by ggml as a custom op (`ggml_custom_4d`): scaled
//! dot-product attention over `heads` heads, read in place from the projections' layout.
//!
//! **Why.** A profile of the SD1.5 UNet step on 2 threads (`perf`, `sd-bench unet`,
//! 2026-12-05) had ggml's CPU flash attention at 21.5% of the step (its tiled kernel and
//! its softmax) for about 3% of the step's floating point work, some 20 GFLOP/s; ggml's
//! `mul_mat` + `soft_max` path was slower still (it writes the whole `[n_kv, n_q]` score
//! matrix of every head, a gigabyte at 64x64 latents). Both also need the heads split
//! out of `[heads * d, n, B]` by copies, and flash attention K and V cast to f16.
//!
//! **How.** For each batch item, head and block of queries (the blocks of all heads shared
//! among the threads): the block's scores `S = scale Q K^T` by one matrix product of the
//! `gemm` crate (see `host_conv_cwh.rs` for why that crate), read straight from the strided
//! head views (row `i` of head `h` starts at `i nb1 + h d`); a softmax per row (max, a
//! vectorisable `exp`, sum); then `O = P V` by a second product written straight into the
//! output rows, each scaled by its row's `1 / sum`. The block of scores stays in L2
//! ([`SCORE_VALUES`]). All in f32 (ggml's flash path rounds K and V to f16).
//!
//! The sums run in another order than ggml's: results agree with ggml's attention to f32
//! rounding and the `exp` approximation (about 2 ulp), not bit for bit.

use std::ffi::{c_int, c_void};

use ggml_sys as sys;

/// Scores a block holds at most (2 MiB of f32; measured on the SD1.5 and VAE shapes: 96 and
/// 160 GFLOP/s on 2 threads against 71 and 101 at 256 KiB).
const SCORE_VALUES: usize = 512 * 1024;

/// The heads and the scale of one attention, packed into the custom op's userdata.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AttentionSpec {
    /// Heads (each `d` of the query's `heads * d` values), below `2^31`.
    pub heads: u32,
    /// The scores' scale (usually `1 / sqrt(d)`).
    pub scale: f32,
    /// The products on bf16 dot products (`host_attention_bf16.rs`) where the CPU has them.
    pub bf16: bool,
}

impl AttentionSpec {
    /// The spec as one integer (the custom op's userdata pointer value).
    pub fn pack(self) -> usize {
        let flags = (self.bf16 as u64) << 63;
        (flags | (self.heads as u64 & 0x7fff_ffff) << 32 | self.scale.to_bits() as u64) as usize
    }

    /// The spec [`pack`](Self::pack) stored.
    pub fn unpack(v: usize) -> AttentionSpec {
        let v = v as u64;
        AttentionSpec {
            heads: ((v >> 32) & 0x7fff_ffff) as u32,
            scale: f32::from_bits(v as u32),
            bf16: v >> 63 == 1,
        }
    }
}

/// Whether this CPU runs the bf16 products of the attention (AVX-512 F and BF16).
pub(crate) fn bf16_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::host_attention_bf16::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// Each compute thread's packed bf16 operands (see `host_attention_bf16.rs`).
    static PACKS: std::cell::RefCell<Vec<u32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A strided f32 operand: `[width, rows, batch]` with contiguous values within a row.
#[derive(Clone, Copy)]
struct Operand {
    data: *const f32,
    /// Values per head.
    head_width: usize,
    rows: usize,
    /// Strides of a row and of a batch item, in values.
    row_stride: usize,
    batch_stride: usize,
}

impl Operand {
    /// The operand of `t` split into `heads` heads.
    ///
    /// # Safety
    /// `t` is a live f32 tensor whose row and batch strides are multiples of 4 bytes.
    unsafe fn of(t: &sys::ggml_tensor, heads: usize) -> Operand {
        Operand {
            data: t.data as *const f32,
            head_width: t.ne[0] as usize / heads,
            rows: t.ne[1] as usize,
            row_stride: t.nb[1] / 4,
            batch_stride: t.nb[2] / 4,
        }
    }

    /// The first value of row `row` of head `head` of batch item `b`.
    ///
    /// # Safety
    /// The indices lie inside the tensor.
    unsafe fn at(&self, b: usize, head: usize, row: usize) -> *const f32 {
        // SAFETY: see the function's contract.
        unsafe {
            self.data
                .add(b * self.batch_stride + row * self.row_stride + head * self.head_width)
        }
    }
}

/// The custom op: `dst` `[heads * dv, n_q, B]` f32 (contiguous) = attention of `src[0]`
/// (q `[heads * d, n_q, B]`), `src[1]` (k `[heads * d, n_kv, B]`) and `src[2]` (v
/// `[heads * dv, n_kv, B]`), all f32 with contiguous rows; thread `ith` of `nth` takes its
/// share of the (batch item, head, query block) items.
///
/// # Safety
/// Called by ggml with a live `dst` built by `Context::attention_host` (types, shapes and
/// strides checked there) and `userdata` the packed [`AttentionSpec`].
pub(crate) unsafe extern "C" fn attention_kernel(
    dst: *mut sys::ggml_tensor,
    ith: c_int,
    nth: c_int,
    userdata: *mut c_void,
) {
    let spec = AttentionSpec::unpack(userdata as usize);
    let heads = spec.heads as usize;
    // SAFETY: see the function's contract.
    let (d, q, k, v) = unsafe {
        let d = &*dst;
        (
            d,
            Operand::of(&*d.src[0], heads),
            Operand::of(&*d.src[1], heads),
            Operand::of(&*d.src[2], heads),
        )
    };
    let out = Operand {
        data: d.data as *const f32,
        head_width: v.head_width,
        rows: q.rows,
        row_stride: d.nb[1] / 4,
        batch_stride: d.nb[2] / 4,
    };
    let batch = d.ne[2] as usize;
    let block = (SCORE_VALUES / k.rows.max(1)).clamp(4, 256).min(q.rows);
    let blocks = q.rows.div_ceil(block);
    let items = batch * heads * blocks;
    let share = super::host_conv::thread_share(items, ith, nth);
    if share.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if spec.bf16
        && q.head_width.is_multiple_of(2)
        && super::host_amx::available()
        && bf16_available()
    {
        // A quarter of the f32 path's score block (512 KiB): the scores are written by the
        // tiles and read twice; 8x40 heads over 4096 keys ran 215 -> 200 ms.
        let block = (SCORE_VALUES / 4 / k.rows.max(1))
            .clamp(32, 256)
            .min(q.rows);
        let blocks = q.rows.div_ceil(block);
        let share = super::host_conv::thread_share(batch * heads * blocks, ith, nth);
        let mp = block.next_multiple_of(32);
        let (dp, dvp) = (
            q.head_width.next_multiple_of(32),
            v.head_width.next_multiple_of(32),
        );
        let np = k.rows.next_multiple_of(32);
        let words = [np * dp / 2, dvp * np / 2, dp / 2 * mp, np / 2 * mp];
        super::host_conv::with_scratch(mp * np + 2 * mp, |buf| {
            PACKS.with_borrow_mut(|packs| {
                let total: usize = words.iter().sum();
                if packs.len() < total {
                    packs.resize(total, 0);
                }
                // SAFETY: the items of this thread's share (see the function's contract);
                // the CPU has AMX-BF16 (checked above).
                unsafe { attend_tiles(&spec, [q, k, v, out], block, share, buf, packs, words) }
            })
        });
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if spec.bf16 && q.head_width.is_multiple_of(2) && bf16_available() {
        let mp = block.next_multiple_of(16);
        let pairs = k.rows.div_ceil(2);
        let words = [
            k.rows * q.head_width / 2,
            pairs * v.head_width,
            q.head_width / 2 * mp,
            pairs * mp,
        ];
        super::host_conv::with_scratch(mp * k.rows + 3 * mp, |buf| {
            PACKS.with_borrow_mut(|packs| {
                let total: usize = words.iter().sum();
                if packs.len() < total {
                    packs.resize(total, 0);
                }
                // SAFETY: the items of this thread's share (see the function's contract);
                // the CPU has the instructions (checked above).
                unsafe { attend_bf16(&spec, [q, k, v, out], block, share, buf, packs, words) }
            })
        });
        return;
    }
    let head = k.rows * (q.head_width + v.head_width);
    super::host_conv::with_scratch(block * k.rows + 2 * block + head, |buf| {
        let (scores, rest) = buf.split_at_mut(block * k.rows);
        let (maxes, rest) = rest.split_at_mut(block);
        let (sums, head) = rest.split_at_mut(block);
        // SAFETY: the items of this thread's share (see the function's contract).
        unsafe {
            attend(
                &spec,
                [q, k, v, out],
                block,
                share,
                scores,
                maxes,
                sums,
                head,
            )
        }
    });
}

/// The items `share` of one attention (item = (batch item, head, block of `block` queries)),
/// with `scores` (`block * n_kv` values), `maxes` and `sums` (`block` each) as scratch, and
/// `head` (`n_kv * (d + dv)` values) for contiguous copies of a head's keys and values:
/// made once per head the share takes, with its next rows prefetched (each row of a head is
/// a few cache lines a whole row of the tensor apart, which the hardware prefetcher does
/// not follow across pages), they let the products pack contiguous rows instead of
/// waiting on every line of the strided ones for each block of queries.
///
/// # Safety
/// The operands are live tensors of the shapes [`attention_kernel`] describes; the items
/// lie inside them.
#[allow(clippy::too_many_arguments)]
unsafe fn attend(
    spec: &AttentionSpec,
    [q, k, v, out]: [Operand; 4],
    block: usize,
    share: std::ops::Range<usize>,
    scores: &mut [f32],
    maxes: &mut [f32],
    sums: &mut [f32],
    head: &mut [f32],
) {
    let heads = spec.heads as usize;
    let (d, dv, n_kv) = (q.head_width, v.head_width, k.rows);
    let (kc, vc) = head.split_at_mut(n_kv * d);
    let mut current = None;
    for item in share {
        let (b, h, r0, m) = item_rows(item, heads, block, q.rows);
        if current != Some((b, h)) {
            // SAFETY: rows 0..n_kv of head h of k and v lie inside them.
            unsafe {
                for j in 0..n_kv {
                    if j + AHEAD < n_kv {
                        prefetch_values(k.at(b, h, j + AHEAD), d);
                        prefetch_values(v.at(b, h, j + AHEAD), dv);
                    }
                    let (kr, vr) = (k.at(b, h, j), v.at(b, h, j));
                    kc[j * d..(j + 1) * d].copy_from_slice(std::slice::from_raw_parts(kr, d));
                    vc[j * dv..(j + 1) * dv].copy_from_slice(std::slice::from_raw_parts(vr, dv));
                }
            }
            current = Some((b, h));
        }
        let scores = &mut scores[..m * k.rows];
        // SAFETY: every view below lies inside its tensor (rows r0..r0+m of q and the
        // output, all n_kv rows of k and v, head h's values of each row).
        unsafe {
            // S = scale Q K^T: [m, n_kv], column-major (the layout the products and the
            // softmax below read fastest: a score column is m contiguous rows).
            gemm::gemm(
                m,
                k.rows,
                q.head_width,
                scores.as_mut_ptr(),
                m as isize,
                1,
                false,
                q.at(b, h, r0),
                1,
                q.row_stride as isize,
                kc.as_ptr(),
                d as isize,
                1,
                0.0,
                spec.scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        softmax_rows_of_columns(scores, &mut maxes[..m], &mut sums[..m]);
        // SAFETY: as above; O = P V written into the output rows.
        unsafe {
            let o = out.at(b, h, r0) as *mut f32;
            gemm::gemm(
                m,
                v.head_width,
                k.rows,
                o,
                1,
                out.row_stride as isize,
                false,
                scores.as_ptr(),
                m as isize,
                1,
                vc.as_ptr(),
                1,
                dv as isize,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
            for (i, sum) in sums.iter().enumerate().take(m) {
                let inv = 1.0 / sum;
                let row = std::slice::from_raw_parts_mut(o.add(i * out.row_stride), v.head_width);
                for x in row {
                    *x *= inv;
                }
            }
        }
    }
}

/// Item `item` of an attention split into (batch item, head, block of `block` of the `rows`
/// queries), blocks innermost: its batch item, head, first query and query count.
fn item_rows(item: usize, heads: usize, block: usize, rows: usize) -> (usize, usize, usize, usize) {
    let blocks = rows.div_ceil(block);
    let (b, rest) = (item / (heads * blocks), item % (heads * blocks));
    let r0 = rest % blocks * block;
    (b, rest / blocks, r0, block.min(rows - r0))
}

/// [`attend`] on bf16 products: `buf` holds `mp * n_kv + 3 mp` f32 values (scores, maxes,
/// sums, reciprocals; `mp` = `block` rounded up to 16), `packs` the four packed operands
/// (`words`: K, V, the query block, the numerators). K and V are packed once per head this
/// thread takes.
///
/// # Safety
/// As [`attend`]; the CPU has AVX-512 F and BF16; the head width of q and k is even.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_bf16(
    spec: &AttentionSpec,
    [q, k, v, out]: [Operand; 4],
    block: usize,
    share: std::ops::Range<usize>,
    buf: &mut [f32],
    packs: &mut [u32],
    words: [usize; 4],
) {
    use super::host_attention_bf16 as bf;
    let heads = spec.heads as usize;
    let (d, dv, n_kv) = (q.head_width, v.head_width, k.rows);
    let pairs = n_kv.div_ceil(2);
    let (kp, rest) = packs.split_at_mut(words[0]);
    let (vp, rest) = rest.split_at_mut(words[1]);
    let (qp, rest) = rest.split_at_mut(words[2]);
    let pp = &mut rest[..words[3]];
    let mut current = None;
    for item in share {
        let (b, h, r0, m) = item_rows(item, heads, block, q.rows);
        let mp = m.next_multiple_of(16);
        let (scores, rest) = buf.split_at_mut(mp * n_kv);
        let (maxes, rest) = rest.split_at_mut(mp);
        let (sums, rest) = rest.split_at_mut(mp);
        let inv = &mut rest[..mp];
        // SAFETY: every view lies inside its tensor (rows r0..r0+m of q and the output, all
        // n_kv rows of k and v, head h's values of each row); the packs are sized by
        // `words` for the largest block.
        unsafe {
            if current != Some((b, h)) {
                bf::pack_rows(k.at(b, h, 0), k.row_stride, n_kv, d, kp);
                bf::pack_values(v.at(b, h, 0), v.row_stride, n_kv, dv, vp);
                current = Some((b, h));
            }
            bf::pack_queries(q.at(b, h, r0), q.row_stride, m, mp, d, qp);
            bf::scores(qp, kp, d / 2, mp, n_kv, spec.scale, scores);
        }
        softmax_rows_of_columns(scores, maxes, sums);
        for (x, s) in inv.iter_mut().zip(sums.iter()) {
            *x = 1.0 / s;
        }
        // SAFETY: as above.
        unsafe {
            bf::pack_scores(scores, mp, n_kv, pp);
            let o = out.at(b, h, r0) as *mut f32;
            bf::values(pp, vp, pairs, mp, dv, m, inv, o, out.row_stride);
        }
    }
}

/// How many rows ahead the attention's packing asks for the rows of a head it will read
/// next: each row of a head is its own few cache lines, a whole row of the tensor apart
/// (`heads` times the head's width), which the hardware prefetcher does not follow across
/// pages; without it the packing waited on every line (a tenth of the tile attention over
/// 4096 keys; 16 rows ahead and 24 within the noise of each other).
const AHEAD: usize = 24;

/// Asks the cache for the `n` f32 values at `p` (a hint: no fault, no effect on results).
#[inline(always)]
fn prefetch_values(p: *const f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let (start, end) = (p as usize, p as usize + 4 * n);
        let mut line = start & !63;
        while line < end {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
            line += 64;
        }
    }
}

/// [`attend`] on AMX tiles (`host_amx.rs`), in the layout of [`attend_bf16`]: per block of
/// queries (`mp` = `block` rounded up to 32), the scores as `S^T = K (scale Q)^T`, i.e. the
/// column-major `[mp, n_kv]` block [`softmax_rows_of_columns`] reads, into `buf`; the
/// numerators packed as pairs of keys (`host_attention_bf16::pack_scores`); `O^T = V^T P^T`
/// scaled by each query's `1 / sum` into the output rows. `packs` holds the four bf16
/// operands (`words`): K as rows `[np][dp]` (`np` = `n_kv`, `dp` = `d` rounded up to 32),
/// V transposed `[dvp][np]`, the scaled query block as pairs of its values `[dp / 2][mp]`
/// and the numerators as pairs of keys `[np / 2][mp]`, the padding zero. K and V are packed
/// once per head this thread takes. The precision of [`attend_bf16`]: Q, K, V and the
/// numerators in bf16, sums in f32.
///
/// # Safety
/// As [`attend`]; the CPU has AMX-BF16 and AVX512-BF16; the head width of q and k is even.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tiles(
    spec: &AttentionSpec,
    [q, k, v, out]: [Operand; 4],
    block: usize,
    share: std::ops::Range<usize>,
    buf: &mut [f32],
    packs: &mut [u32],
    words: [usize; 4],
) {
    use super::host_amx::{Blocks, BLOCK};
    use super::host_attention_bf16 as bf;
    let heads = spec.heads as usize;
    let (d, dv, n_kv) = (q.head_width, v.head_width, k.rows);
    let (dp, dvp, np) = (
        d.next_multiple_of(BLOCK),
        dv.next_multiple_of(BLOCK),
        n_kv.next_multiple_of(BLOCK),
    );
    let (ka, rest) = packs.split_at_mut(words[0]);
    let (va, rest) = rest.split_at_mut(words[1]);
    let (qb, rest) = rest.split_at_mut(words[2]);
    let pb = &mut rest[..words[3]];
    // SAFETY: the bf16 rows viewed as 16-bit values (two a word).
    let ka = unsafe { std::slice::from_raw_parts_mut(ka.as_mut_ptr() as *mut u16, ka.len() * 2) };
    let va = unsafe { std::slice::from_raw_parts_mut(va.as_mut_ptr() as *mut u16, va.len() * 2) };
    // One row of q, k or v as bf16.
    let mut row16 = vec![0u16; d.max(dv)];
    // SAFETY: the caller checked the CPU.
    let mut tiles = unsafe { Blocks::new() };
    let mut c = [0f32; BLOCK * BLOCK];
    let mut inv = [0f32; 256];
    let mut current = None;
    for item in share {
        let (b, h, r0, m) = item_rows(item, heads, block, q.rows);
        let mp = m.next_multiple_of(BLOCK);
        // SAFETY: every view lies inside its tensor (rows r0..r0+m of q and the output, all
        // n_kv rows of k and v, head h's values of each row); the packs and `buf` are sized
        // for the largest block.
        unsafe {
            if current != Some((b, h)) {
                ka.fill(0);
                for j in 0..n_kv {
                    if j + AHEAD < n_kv {
                        prefetch_values(k.at(b, h, j + AHEAD), d);
                    }
                    bf::bf16_scaled_row(k.at(b, h, j), d, 1.0, ka[j * dp..].as_mut_ptr());
                }
                va.fill(0);
                for j in 0..n_kv {
                    if j + AHEAD < n_kv {
                        prefetch_values(v.at(b, h, j + AHEAD), dv);
                    }
                    bf::bf16_scaled_row(v.at(b, h, j), dv, 1.0, row16.as_mut_ptr());
                    for (cc, x) in row16[..dv].iter().enumerate() {
                        va[cc * np + j] = *x;
                    }
                }
                current = Some((b, h));
            }
            qb[..dp / 2 * mp].fill(0);
            for i in 0..m {
                if i + AHEAD < m {
                    prefetch_values(q.at(b, h, r0 + i + AHEAD), d);
                }
                bf::bf16_scaled_row(q.at(b, h, r0 + i), d, spec.scale, row16.as_mut_ptr());
                for p in 0..d / 2 {
                    qb[p * mp + i] = row16[2 * p] as u32 | (row16[2 * p + 1] as u32) << 16;
                }
            }
            // S^T: key rows (32 a block) by query columns, `mp` f32 a key.
            let s = buf.as_mut_ptr();
            if dp == 2 * BLOCK {
                // Each 32 queries fit four tiles (heads of 33 to 64 values).
                for i0 in (0..mp).step_by(BLOCK) {
                    let (a, bq) = (ka.as_ptr() as *const u8, qb.as_ptr().add(i0) as *const u8);
                    tiles.scores_to(bq, mp * 4, a, dp * 2, np, s.add(i0), mp * 4);
                }
            } else {
                for j0 in (0..np).step_by(BLOCK) {
                    let a = ka.as_ptr().add(j0 * dp) as *const u8;
                    for i0 in (0..mp).step_by(BLOCK) {
                        let bp = qb.as_ptr().add(i0) as *const u8;
                        tiles.run_to(
                            a,
                            dp * 2,
                            bp,
                            mp * 4,
                            dp / BLOCK,
                            s.add(j0 * mp + i0),
                            mp * 4,
                        );
                    }
                }
            }
        }
        let (scores, rest) = buf.split_at_mut(mp * n_kv);
        let (maxes, sums) = rest.split_at_mut(mp);
        softmax_pairs_of_columns(scores, maxes, &mut sums[..mp], &mut pb[..np / 2 * mp]);
        for (x, s) in inv.iter_mut().zip(sums.iter()).take(mp) {
            *x = 1.0 / s;
        }
        // SAFETY: as above; the output rows r0..r0+m of head h are written.
        unsafe {
            for c0 in (0..dvp).step_by(BLOCK) {
                let a = va.as_ptr().add(c0 * np) as *const u8;
                // The last block of value rows: its top half alone where the rest is padding.
                let half = dv - c0 <= BLOCK / 2;
                for i0 in (0..m).step_by(BLOCK) {
                    let bp = pb.as_ptr().add(i0) as *const u8;
                    if half {
                        let cp = c.as_mut_ptr();
                        tiles.run_half_to(a, np * 2, bp, mp * 4, np / BLOCK, cp, BLOCK * 4);
                    } else {
                        tiles.run(a, np * 2, bp, mp * 4, np / BLOCK, &mut c);
                    }
                    for cc in 0..BLOCK.min(dv.saturating_sub(c0)) {
                        let col = &c[cc * BLOCK..(cc + 1) * BLOCK];
                        for (i, y) in col.iter().enumerate().take(m - i0) {
                            let o = out.at(b, h, r0 + i0 + i) as *mut f32;
                            *o.add(c0 + cc) = y * inv[i0 + i];
                        }
                    }
                }
            }
        }
    }
    drop(tiles);
}

/// [`softmax_rows_of_columns`] with the numerators written as bf16 pairs of consecutive
/// columns (keys `2r` and `2r + 1` of row `i` in `pairs[r * m + i]`, the tiles' layout of
/// the second product; a missing last key and the pairs past the keys zero) instead of in
/// place: one pass over the scores less.
fn softmax_pairs_of_columns(s: &[f32], maxes: &mut [f32], sums: &mut [f32], pairs: &mut [u32]) {
    let m = maxes.len();
    #[cfg(target_arch = "x86_64")]
    if m.is_multiple_of(16) && super::host_attention_bf16::available() {
        // SAFETY: the CPU has AVX-512 F, BW and BF16; `m` is a multiple of 16.
        unsafe { softmax_pairs_avx512(s, maxes, sums, pairs) };
        return;
    }
    let n = s.len() / m.max(1);
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    for col in s.chunks_exact(m) {
        for (mx, v) in maxes.iter_mut().zip(col) {
            *mx = mx.max(*v);
        }
    }
    let bits = |x: f32| {
        let u = x.to_bits();
        // Numerators are finite and non-negative: round to nearest even.
        u.wrapping_add(0x7fff + (u >> 16 & 1)) >> 16
    };
    for (r, dst) in pairs.chunks_exact_mut(m).enumerate() {
        let (a, b) = (2 * r, 2 * r + 1);
        if b < n {
            let (ca, cb) = (&s[a * m..(a + 1) * m], &s[b * m..(b + 1) * m]);
            for ((((d, x), y), mx), sum) in dst
                .iter_mut()
                .zip(ca)
                .zip(cb)
                .zip(maxes.iter())
                .zip(sums.iter_mut())
            {
                let (ea, eb) = (exp_nonpositive(x - mx), exp_nonpositive(y - mx));
                *sum += ea + eb;
                *d = bits(ea) | bits(eb) << 16;
            }
        } else if a < n {
            let ca = &s[a * m..(a + 1) * m];
            for (((d, x), mx), sum) in dst
                .iter_mut()
                .zip(ca)
                .zip(maxes.iter())
                .zip(sums.iter_mut())
            {
                let ea = exp_nonpositive(x - mx);
                *sum += ea;
                *d = bits(ea);
            }
        } else {
            dst.fill(0);
        }
    }
}

/// [`softmax_pairs_of_columns`] in AVX-512 registers, 16 rows at a time: LLVM keeps the
/// portable loops at 256-bit vectors on the CPUs that have AMX (their `prefer-256-bit`
/// tuning), here half the work a pass. The exponential is [`exp2_for_bf16_avx512`] of the
/// scores scaled by `log2(e)` less their row's maximum so scaled (one fused multiply-add
/// instead of a subtraction and a multiplication); the two keys of each pair are rounded
/// to bf16 by one `vcvtne2ps2bf16` (to nearest even, as the scalar path) and interleaved
/// into words by one `vpermw`. A NaN score is not kept: the attention's inputs are finite.
///
/// # Safety
/// The CPU has AVX-512 F, BW and BF16; `maxes.len()` is a multiple of 16; `s`, `sums`,
/// `pairs` as for [`softmax_pairs_of_columns`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn softmax_pairs_avx512(s: &[f32], maxes: &mut [f32], sums: &mut [f32], pairs: &mut [u32]) {
    use std::arch::x86_64::*;
    let m = maxes.len();
    let n = s.len() / m.max(1);
    let sp = s.as_ptr();
    let log2e = _mm512_set1_ps(std::f32::consts::LOG2_E);
    // Word `i` of the pair vector: bf16 `i` (the first key's) and `16 + i` (the second's).
    let interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    );
    // SAFETY: columns `0..n` of `m` values lie in `s`; `pairs` rows of `m` words; `maxes` and
    // `sums` hold `m` values; `i + 16 <= m`.
    unsafe {
        for i in (0..m).step_by(16) {
            let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
            for col in 0..n {
                mx = _mm512_max_ps(mx, _mm512_loadu_ps(sp.add(col * m + i)));
            }
            _mm512_storeu_ps(maxes.as_mut_ptr().add(i), mx);
            let top = _mm512_mul_ps(mx, log2e);
            let exp = |col: usize| {
                let t = _mm512_fmsub_ps(_mm512_loadu_ps(sp.add(col * m + i)), log2e, top);
                exp2_for_bf16_avx512(t)
            };
            let mut sum = _mm512_setzero_ps();
            for (r, dst) in pairs.chunks_exact_mut(m).enumerate() {
                let (a, b) = (2 * r, 2 * r + 1);
                let (ea, eb) = if b < n {
                    (exp(a), exp(b))
                } else if a < n {
                    (exp(a), _mm512_setzero_ps())
                } else {
                    (_mm512_setzero_ps(), _mm512_setzero_ps())
                };
                sum = _mm512_add_ps(sum, _mm512_add_ps(ea, eb));
                let both = std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(eb, ea));
                let word = _mm512_permutexvar_epi16(interleave, both);
                _mm512_storeu_si512(dst.as_mut_ptr().add(i) as *mut __m512i, word);
            }
            _mm512_storeu_ps(sums.as_mut_ptr().add(i), sum);
        }
    }
}

/// The softmax numerators of the rows of `s`, a column-major `[m, n]` block (`m` =
/// `maxes.len()`): each value replaced by `exp(value - max of its row)`; `sums` receives
/// each row's sum. Every loop runs down a column, `m` independent rows in vector lanes.
fn softmax_rows_of_columns(s: &mut [f32], maxes: &mut [f32], sums: &mut [f32]) {
    let m = maxes.len();
    #[cfg(target_arch = "x86_64")]
    if m.is_multiple_of(16) && std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512 F; `m` is a multiple of 16.
        unsafe { softmax_rows_avx512(s, maxes, sums) };
        return;
    }
    maxes.fill(f32::NEG_INFINITY);
    sums.fill(0.0);
    for col in s.chunks_exact(m) {
        for (mx, v) in maxes.iter_mut().zip(col) {
            *mx = mx.max(*v);
        }
    }
    for col in s.chunks_exact_mut(m) {
        for ((v, mx), sum) in col.iter_mut().zip(maxes.iter()).zip(sums.iter_mut()) {
            *v = exp_nonpositive(*v - mx);
            *sum += *v;
        }
    }
}

/// [`softmax_rows_of_columns`] in AVX-512 registers, 16 rows at a time, in the same column
/// order (the binary is built for baseline x86-64: the portable loop runs 128-bit vectors
/// there). Same operations as [`exp_nonpositive`], fused (a NaN score is not kept: the
/// attention's inputs are finite).
///
/// # Safety
/// The CPU has AVX-512 F; `maxes.len()` is a multiple of 16; `s` holds whole columns of
/// `maxes.len()` values; `sums` as long as `maxes`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_rows_avx512(s: &mut [f32], maxes: &mut [f32], sums: &mut [f32]) {
    use std::arch::x86_64::*;
    let m = maxes.len();
    let n = s.len() / m.max(1);
    let sp = s.as_mut_ptr();
    let (mp, up) = (maxes.as_mut_ptr(), sums.as_mut_ptr());
    // SAFETY: every offset below is `col * m + i` with `col < n` and `i + 16 <= m`, inside
    // `s`, or `i + 16 <= m`, inside `maxes` and `sums`.
    unsafe {
        for i in (0..m).step_by(16) {
            _mm512_storeu_ps(mp.add(i), _mm512_set1_ps(f32::NEG_INFINITY));
            _mm512_storeu_ps(up.add(i), _mm512_setzero_ps());
        }
        for col in 0..n {
            for i in (0..m).step_by(16) {
                let v = _mm512_loadu_ps(sp.add(col * m + i));
                _mm512_storeu_ps(mp.add(i), _mm512_max_ps(_mm512_loadu_ps(mp.add(i)), v));
            }
        }
        for col in 0..n {
            for i in (0..m).step_by(16) {
                let at = sp.add(col * m + i);
                let e = exp_nonpositive_avx512(_mm512_sub_ps(
                    _mm512_loadu_ps(at),
                    _mm512_loadu_ps(mp.add(i)),
                ));
                _mm512_storeu_ps(at, e);
                _mm512_storeu_ps(up.add(i), _mm512_add_ps(_mm512_loadu_ps(up.add(i)), e));
            }
        }
    }
}

/// `e^x` of 16 lanes with `x <= 0`: [`exp2_for_bf16_avx512`] of `x log2(e)` (the tests'
/// form of the attention's exponential, which folds the scaling into its subtraction).
#[cfg(all(target_arch = "x86_64", test))]
#[target_feature(enable = "avx512f")]
#[inline]
fn exp_for_bf16_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    exp2_for_bf16_avx512(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)))
}

/// `2^t` of 16 lanes with `t <= 0`, to within 1.1e-4 relative (bf16 keeps 8 bits: its
/// rounding is 18 times coarser), in 7 operations where [`exp_nonpositive_avx512`] takes
/// about 17: `n` = `t` rounded, `f = t - n` in `[-1/2, 1/2]`, `2^f` by a cubic fitted for
/// the least relative error there (1.0e-4; the Taylor quartic before it: 5.6e-5, one
/// multiply-add more), and `scalef` applying `2^n` (0 below the normal floats). Below
/// `-150`, where `2^t` is 0 in f32, `t` is clamped there: `-inf` gives 0, not NaN. For the
/// bf16 numerators of the attention on AMX tiles, 1.3 billion exponentials in an SD1.5
/// UNet step at 64x64 latents.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn exp2_for_bf16_avx512(t: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let t = _mm512_max_ps(t, _mm512_set1_ps(-150.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(t);
    let f = _mm512_sub_ps(t, n);
    let mut p = _mm512_set1_ps(5.500_895e-2);
    for c in [2.422_11e-1, 6.932_829e-1, 1.0] {
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// [`exp_nonpositive`] of 16 lanes (fused multiply-adds; a NaN lane is not kept).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn exp_nonpositive_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(-87.3));
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.3));
    let shift = _mm512_set1_ps(12_582_912.0);
    let t = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), shift);
    let nn = _mm512_sub_ps(t, shift);
    let r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(nn, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let er = _mm512_add_ps(
        _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r),
        _mm512_set1_ps(1.0),
    );
    let biased = _mm512_add_epi32(
        _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(shift)),
        _mm512_set1_epi32(127),
    );
    let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(biased));
    _mm512_maskz_mul_ps(!under, er, scale)
}

/// `e^x` for `x <= 0` (scores minus their row's maximum; `NaN` stays `NaN`), branch-free and
/// free of float-to-integer casts (Rust's saturating `as` is scalar code) so that a loop of
/// it vectorises: `x = n ln 2 + r` with `|r| <= ln 2 / 2`, `n` rounded by adding
/// `1.5 * 2^23` (its integer value then sits in the sum's low mantissa bits), `e^r` by the
/// degree-6 minimax polynomial of the Cephes library's `expf`, times `2^n` built in the
/// exponent bits. Below `-87.3` (where `e^x` leaves the normal floats) the result is 0.
#[inline(always)]
pub(crate) fn exp_nonpositive(input: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n * LN2_HI is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const SHIFT: f32 = 12_582_912.0;
    let underflow = input < -87.3;
    let x = input.max(-87.3);
    let t = x * LOG2E + SHIFT;
    let n = t - SHIFT;
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4_f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, 0.5 in f32
    let er = p * r * r + r + 1.0;
    // n + 127 in [1, 127]: the biased exponent of 2^n.
    let biased = t.to_bits().wrapping_sub(SHIFT.to_bits()).wrapping_add(127);
    let scale = f32::from_bits(biased << 23);
    let y = if underflow { 0.0 } else { er * scale };
    if input.is_nan() {
        input
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_packs_into_one_word() {
        for bf16 in [false, true] {
            let s = AttentionSpec {
                heads: 8,
                scale: 0.158_113_9,
                bf16,
            };
            assert_eq!(AttentionSpec::unpack(s.pack()), s);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_bf16_numerators_exp_is_within_bf16s_precision() {
        use std::arch::x86_64::*;
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("skipped: no AVX-512");
            return;
        }
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -120.0 {
            let lanes: [f32; 16] = std::array::from_fn(|i| x - i as f32 * 0.0137);
            let mut got = [0f32; 16];
            // SAFETY: the CPU has AVX-512 F; 16 values in and out.
            unsafe {
                let e = exp_for_bf16_avx512(_mm512_loadu_ps(lanes.as_ptr()));
                _mm512_storeu_ps(got.as_mut_ptr(), e);
            }
            for (v, g) in lanes.iter().zip(got) {
                let want = (*v as f64).exp();
                if want > 1.2e-38 {
                    worst = worst.max((g as f64 - want).abs() / want);
                } else {
                    // Below the normal floats: zero or a tiny value.
                    assert!((0.0..1.2e-38).contains(&g), "e^{v} = {g}");
                }
            }
            x -= 0.0911;
        }
        assert!(worst < 1.1e-4, "relative error {worst}");
    }

    #[test]
    fn exp_is_within_a_few_ulp_of_std() {
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -87.0 {
            let (got, want) = (exp_nonpositive(x), x.exp());
            let ulps = ((got - want).abs() / (want * f32::EPSILON)) as f64;
            worst = worst.max(ulps);
            x -= 0.001_37;
        }
        assert!(worst <= 3.0, "worst error {worst} ulp");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }

    #[test]
    fn softmax_runs_along_the_rows_of_a_column_major_block() {
        let (m, n) = (3, 19);
        // Row i, column j at j * m + i.
        let mut s: Vec<f32> = (0..m * n)
            .map(|x| ((x % m) as f32 - 1.0) * 2.0 + (x / m) as f32 * 0.5)
            .collect();
        let rows: Vec<Vec<f32>> = (0..m)
            .map(|i| (0..n).map(|j| s[j * m + i]).collect())
            .collect();
        let (mut maxes, mut sums) = (vec![0f32; m], vec![0f32; m]);
        softmax_rows_of_columns(&mut s, &mut maxes, &mut sums);
        for (i, row) in rows.iter().enumerate() {
            let max = row.iter().cloned().fold(f32::MIN, f32::max);
            let want: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
            for (j, w) in want.iter().enumerate() {
                let g = s[j * m + i];
                assert!(
                    (g - w).abs() <= 4.0 * f32::EPSILON * w.max(1e-30),
                    "{g} {w}"
                );
            }
            assert!((sums[i] - want.iter().sum::<f32>()).abs() < 1e-5);
        }
    }
}
