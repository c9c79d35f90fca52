//! Graph operations on a [`Context`], each checked before ggml sees it.
//!
//! ggml asserts (aborts the process) on operands it cannot handle. Each method here checks
//! the conditions ggml asserts on for that op and returns [`GgmlError::InvalidOperands`]
//! instead. Dimensions are ggml's: `ne[0]` is the innermost (width, or features).

use ggml_sys as sys;

use super::context::Context;
use super::error::{GgmlError, Result};
use super::tensor::GTensor;
use crate::dtype::DType;

/// Interpolation mode of [`Context::interpolate`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Interpolation {
    /// Nearest neighbour.
    Nearest,
    /// Bilinear, half-pixel centres (`align_corners = false`).
    Bilinear,
    /// Bilinear with `align_corners = true`.
    BilinearAlignCorners,
}

/// Accumulation precision for matmul-like ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// The backend's default.
    Default,
    /// Force f32 accumulation.
    F32,
}

/// The name of the node [`Context::attention_host`] makes (a `CUSTOM` op: counters of the
/// graph's work find it by this name; its sources are q, k and v).
pub const ATTENTION_HOST_NAME: &str = "attention_host";

/// The name of the node [`Context::geglu_host`] makes (a `CUSTOM` op; its source is the
/// projection `[2 I, ...]`).
pub const GEGLU_HOST_NAME: &str = "geglu_host";

/// The name of the node [`Context::gelu_tanh_host`] makes (a `CUSTOM` op; its sources are
/// the GELU's input and, where given, the factor).
pub const GELU_TANH_HOST_NAME: &str = "gelu_tanh_host";

/// The name of the node [`Context::group_norm_host`] makes (a `CUSTOM` op; its sources are
/// the input, the scales and the shifts).
pub const GROUP_NORM_HOST_NAME: &str = "group_norm_host";

/// The name of the node [`Context::linear`] makes on the CPU kernel (a `CUSTOM` op; its
/// sources are the input `[K, ...]` and the weight `[K, M]`).
pub const LINEAR_HOST_NAME: &str = "linear_host";

/// The name of the node an implicit convolution of [`Context::conv_2d_host`] makes (a
/// `CUSTOM` op, see [`Context::set_f32_products`]; its sources are the input and the kernel
/// `[KW, KH, C, OC]`).
pub const IMPLICIT_CONV_NAME: &str = "conv_2d_implicit";

/// The name of the node of a convolution's product on AMX tiles (bf16 kernels where the
/// CPU has AMX-BF16, see [`cpu_amx_bf16`](super::cpu_amx_bf16); a `CUSTOM` op whose sources
/// are the bf16 im2col and the kernel `[KW, KH, C, OC]`).
pub const TILE_CONV_NAME: &str = "conv_2d_tiles";

/// The name of the node of a convolution's f32 product after this crate's f32 im2col (f16
/// kernels the implicit convolution does not take, see [`Context::set_f32_products`]; a
/// `CUSTOM` op whose sources are the im2col and the kernel `[KW, KH, C, OC]`).
pub const IM2COL_CONV_NAME: &str = "conv_2d_im2col";

fn bad(op: &'static str, detail: String) -> GgmlError {
    GgmlError::InvalidOperands { op, detail }
}

/// The type of a convolution's im2col for a kernel of `kernel` type: f32 for exact f32
/// kernels; for bf16 kernels bf16 with this crate's im2col (`host`), else f32 (ggml's CPU
/// product takes bf16 kernels against bf16 or f32 columns only, and widens f16 to f32 for
/// f32 kernels alone); f16 otherwise.
fn ggml_im2col_type(kernel: Option<DType>, exact_f32: bool, host: bool) -> sys::ggml_type {
    match kernel {
        Some(DType::BF16) if host => sys::GGML_TYPE_BF16,
        Some(DType::BF16) => sys::GGML_TYPE_F32,
        Some(DType::F32) if exact_f32 => sys::GGML_TYPE_F32,
        _ => sys::GGML_TYPE_F16,
    }
}

/// One custom op of this crate's CPU kernels giving a convolution's f32 output
/// `[ow, oh, oc, n]` (`out`) from `src` (the input or its im2col), the kernel and the bias
/// when there is one, with `userdata`.
///
/// # Safety
/// `c` is a live no-alloc context; `fun` accepts these sources and this output.
unsafe fn conv_output_op(
    c: *mut sys::ggml_context,
    src: *mut sys::ggml_tensor,
    kernel: &GTensor,
    bias: Option<&GTensor>,
    out: [usize; 4],
    fun: sys::ggml_custom_op_t,
    userdata: usize,
) -> *mut sys::ggml_tensor {
    let mut args = [
        src,
        kernel.raw(),
        bias.map_or(std::ptr::null_mut(), |b| b.raw()),
    ];
    // SAFETY: see the function's contract.
    unsafe {
        sys::ggml_custom_4d(
            c,
            sys::GGML_TYPE_F32,
            out[0] as i64,
            out[1] as i64,
            out[2] as i64,
            out[3] as i64,
            args.as_mut_ptr(),
            if bias.is_some() { 3 } else { 2 },
            fun,
            sys::GGML_N_TASKS_MAX,
            userdata as *mut std::ffi::c_void,
        )
    }
}

/// This crate's im2col of `input` (`[W, H, C, n]` f32, contiguous rows) as `dtype`:
/// `[k, ow, oh, n]` (see `host_conv.rs`).
///
/// # Safety
/// `c` is a live no-alloc context; `g` is the convolution's geometry, `k`, `ow`, `oh` its
/// sizes for this input.
unsafe fn host_im2col(
    c: *mut sys::ggml_context,
    input: &GTensor,
    dtype: sys::ggml_type,
    [k, ow, oh, n]: [usize; 4],
    g: super::host_conv::Im2colGeometry,
) -> *mut sys::ggml_tensor {
    let mut args = [input.raw()];
    // SAFETY: see the function's contract.
    unsafe {
        sys::ggml_custom_4d(
            c,
            dtype,
            k as i64,
            ow as i64,
            oh as i64,
            n as i64,
            args.as_mut_ptr(),
            1,
            Some(super::host_conv::im2col_kernel),
            sys::GGML_N_TASKS_MAX,
            g.pack() as *mut std::ffi::c_void,
        )
    }
}

fn can_repeat(b: &GTensor, a: &GTensor) -> bool {
    let (an, bn) = (a.ne(), b.ne());
    (0..4).all(|i| bn[i] != 0 && an[i] % bn[i] == 0)
}

fn same_shape(a: &GTensor, b: &GTensor) -> bool {
    a.ne() == b.ne()
}

impl Context {
    /// Runs `f` under the context lock after checking room for `tensors` descriptors.
    fn op(
        &self,
        name: &'static str,
        tensors: usize,
        f: impl FnOnce(*mut sys::ggml_context) -> *mut sys::ggml_tensor,
    ) -> Result<GTensor> {
        if !self.is_no_alloc() {
            return Err(bad(name, "graph operations need a no_alloc context".into()));
        }
        let _g = self.lock();
        self.ensure_room(name, tensors, 0)?;
        let t = f(self.raw());
        if t.is_null() {
            return Err(bad(name, "ggml returned no tensor".into()));
        }
        Ok(GTensor::from_raw(self.clone(), t))
    }

    /// One of this crate's CPU kernels as a ggml custom op named `name`: an f32 result of
    /// dims `ne` computed by `fun` from `args` with `userdata`, on every thread.
    ///
    /// # Safety
    /// `fun` accepts these sources, this output and this `userdata` (the caller checked the
    /// shapes, types and strides it relies on).
    unsafe fn host_kernel_op(
        &self,
        name: &'static str,
        ne: [usize; 4],
        args: &[&GTensor],
        fun: sys::ggml_custom_op_t,
        userdata: usize,
    ) -> Result<GTensor> {
        let mut raw: Vec<*mut sys::ggml_tensor> = args.iter().map(|t| t.raw()).collect();
        // SAFETY: see the function's contract.
        let t = unsafe { self.custom_f32(name, ne, &mut raw, fun, userdata) }?;
        t.set_name(name);
        Ok(t)
    }

    /// The ggml custom op under [`host_kernel_op`](Self::host_kernel_op) (and
    /// [`channel_affine`](Self::channel_affine), whose optional sources are null): an f32
    /// result of dims `ne` computed by `fun` from the sources `raw` with `userdata`, on every
    /// thread; `name` is for errors only.
    ///
    /// # Safety
    /// As [`host_kernel_op`](Self::host_kernel_op), for the sources in `raw`.
    unsafe fn custom_f32(
        &self,
        name: &'static str,
        ne: [usize; 4],
        raw: &mut [*mut sys::ggml_tensor],
        fun: sys::ggml_custom_op_t,
        userdata: usize,
    ) -> Result<GTensor> {
        // SAFETY: see the function's contract.
        self.op(name, 1, |c| unsafe {
            sys::ggml_custom_4d(
                c,
                sys::GGML_TYPE_F32,
                ne[0] as i64,
                ne[1] as i64,
                ne[2] as i64,
                ne[3] as i64,
                raw.as_mut_ptr(),
                raw.len() as i32,
                fun,
                sys::GGML_N_TASKS_MAX,
                userdata as *mut std::ffi::c_void,
            )
        })
    }

    fn binary(
        &self,
        name: &'static str,
        a: &GTensor,
        b: &GTensor,
        f: unsafe extern "C" fn(
            *mut sys::ggml_context,
            *mut sys::ggml_tensor,
            *mut sys::ggml_tensor,
        ) -> *mut sys::ggml_tensor,
    ) -> Result<GTensor> {
        if !can_repeat(b, a) {
            return Err(bad(
                name,
                format!("{:?} does not broadcast to {:?}", b.ne(), a.ne()),
            ));
        }
        if a.dtype() != Some(DType::F32)
            && a.dtype() != Some(DType::F16)
            && a.dtype() != Some(DType::BF16)
        {
            return Err(bad(name, format!("unsupported type {:?}", a.dtype())));
        }
        // SAFETY: operands checked; room checked in `op`.
        self.op(name, 1, |c| unsafe { f(c, a.raw(), b.raw()) })
    }

    /// `a + b`, `b` broadcast to `a`'s shape.
    pub fn add(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        self.binary("add", a, b, sys::ggml_add)
    }
    /// `a - b`, `b` broadcast to `a`'s shape.
    pub fn sub(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        self.binary("sub", a, b, sys::ggml_sub)
    }
    /// `a * b` elementwise, `b` broadcast to `a`'s shape.
    pub fn mul(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        self.binary("mul", a, b, sys::ggml_mul)
    }
    /// `a / b` elementwise, `b` broadcast to `a`'s shape.
    pub fn div(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        self.binary("div", a, b, sys::ggml_div)
    }

    /// `a * s`.
    pub fn scale(&self, a: &GTensor, s: f32) -> Result<GTensor> {
        // SAFETY: any float tensor.
        self.op("scale", 1, |c| unsafe { sys::ggml_scale(c, a.raw(), s) })
    }

    /// `a * s + b` (ggml's `scale` with a bias).
    pub fn scale_bias(&self, a: &GTensor, s: f32, b: f32) -> Result<GTensor> {
        // SAFETY: any float tensor.
        self.op("scale_bias", 1, |c| unsafe {
            sys::ggml_scale_bias(c, a.raw(), s, b)
        })
    }

    fn unary(
        &self,
        name: &'static str,
        a: &GTensor,
        f: unsafe extern "C" fn(
            *mut sys::ggml_context,
            *mut sys::ggml_tensor,
        ) -> *mut sys::ggml_tensor,
    ) -> Result<GTensor> {
        if a.dtype().is_none_or(|d| !d.is_float() || d == DType::F64) {
            return Err(bad(name, format!("unsupported type {:?}", a.dtype())));
        }
        // SAFETY: unary op on a float tensor.
        self.op(name, 1, |c| unsafe { f(c, a.raw()) })
    }

    /// SiLU (`x * sigmoid(x)`).
    pub fn silu(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("silu", a, sys::ggml_silu)
    }
    /// GELU (tanh approximation, as ggml computes it).
    pub fn gelu(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("gelu", a, sys::ggml_gelu)
    }
    /// GELU with the exact erf formula.
    pub fn gelu_erf(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("gelu_erf", a, sys::ggml_gelu_erf)
    }
    /// GEGLU of `a` `[2 I, ...]` in one op: its first `I` values times the GELU of its
    /// last `I` (diffusers' `GEGLU`: `value * gelu(gate)`), `[I, ...]`; `erf` selects the
    /// exact GELU, otherwise ggml's tanh approximation (as [`gelu`](Self::gelu)). Needs
    /// rows of contiguous floats of even width. One pass and no copies of the halves: the
    /// feed-forward's largest intermediates are the projection and this output only.
    pub fn geglu(&self, a: &GTensor, erf: bool) -> Result<GTensor> {
        let ne = a.ne();
        let Some(d) = a.dtype().filter(|d| d.is_float() && *d != DType::F64) else {
            return Err(bad("geglu", format!("unsupported type {:?}", a.dtype())));
        };
        if ne[0] == 0
            || !ne[0].is_multiple_of(2)
            || a.nb()[0] != d.type_size()
            || !a.is_contiguous_1()
        {
            return Err(bad(
                "geglu",
                format!(
                    "needs contiguous rows of even width, got {ne:?} strides {:?}",
                    a.nb()
                ),
            ));
        }
        let f = if erf {
            sys::ggml_geglu_erf_swapped
        } else {
            sys::ggml_geglu_swapped
        };
        // SAFETY: float tensor with contiguous rows of even width (ggml_glu's assertion).
        self.op("geglu", 1, |c| unsafe { f(c, a.raw()) })
    }
    /// GELU with the quick sigmoid approximation (CLIP's `quick_gelu`).
    pub fn gelu_quick(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("gelu_quick", a, sys::ggml_gelu_quick)
    }
    /// ReLU.
    pub fn relu(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("relu", a, sys::ggml_relu)
    }
    /// tanh.
    pub fn tanh(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("tanh", a, sys::ggml_tanh)
    }
    /// Sigmoid.
    pub fn sigmoid(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("sigmoid", a, sys::ggml_sigmoid)
    }
    /// A contiguous copy.
    pub fn cont(&self, a: &GTensor) -> Result<GTensor> {
        // SAFETY: any tensor.
        self.op("cont", 1, |c| unsafe { sys::ggml_cont(c, a.raw()) })
    }

    /// Leaky ReLU with slope `negative_slope` for negative inputs.
    pub fn leaky_relu(&self, a: &GTensor, negative_slope: f32) -> Result<GTensor> {
        // SAFETY: float tensor.
        self.op("leaky_relu", 1, |c| unsafe {
            sys::ggml_leaky_relu(c, a.raw(), negative_slope, false)
        })
    }

    /// Clamps every element of `a` to `[min, max]`.
    pub fn clamp(&self, a: &GTensor, min: f32, max: f32) -> Result<GTensor> {
        if min.is_nan() || max.is_nan() || min > max {
            return Err(bad("clamp", format!("range [{min}, {max}]")));
        }
        // SAFETY: float tensor, ordered bounds.
        self.op("clamp", 1, |c| unsafe {
            sys::ggml_clamp(c, a.raw(), min, max)
        })
    }

    /// Softplus, `ln(1 + e^x)` (`x` itself above 20, as torch's default threshold).
    pub fn softplus(&self, a: &GTensor) -> Result<GTensor> {
        self.unary("softplus", a, sys::ggml_softplus)
    }

    /// Depthwise 2-D convolution of `input` `[W, H, C, N]` with `kernel` `[KW, KH, 1, C]`
    /// (one filter per channel, PyTorch's `groups = C`), computed directly in f32.
    pub fn conv_2d_dw_direct(
        &self,
        kernel: &GTensor,
        input: &GTensor,
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
    ) -> Result<GTensor> {
        let (kn, xn) = (kernel.ne(), input.ne());
        if kn[2] != 1 || kn[3] != xn[2] {
            return Err(bad(
                "conv_2d_dw_direct",
                format!(
                    "kernel {kn:?} is not [KW, KH, 1, {}] for input {xn:?}",
                    xn[2]
                ),
            ));
        }
        if !matches!(kernel.dtype(), Some(DType::F32 | DType::F16))
            || input.dtype() != Some(DType::F32)
            || !input.is_contiguous()
        {
            return Err(bad(
                "conv_2d_dw_direct",
                format!(
                    "kernel {:?} and contiguous f32 input ({:?}) required",
                    kernel.dtype(),
                    input.dtype()
                ),
            ));
        }
        self.check_conv([kn[0], kn[1], xn[2], kn[3]], xn, stride, pad, dilation)?;
        // SAFETY: shapes and types checked.
        self.op("conv_2d_dw_direct", 1, |c| unsafe {
            sys::ggml_conv_2d_dw_direct(
                c,
                kernel.raw(),
                input.raw(),
                stride.0 as i32,
                stride.1 as i32,
                pad.0 as i32,
                pad.1 as i32,
                dilation.0 as i32,
                dilation.1 as i32,
            )
        })
    }

    /// Matrix product: `a` is `[k, m, ...]`, `b` is `[k, n, ...]`, the result `[m, n, ...]`
    /// (`b @ a^T` in row-major terms), with `a` broadcast over dims 2 and 3.
    pub fn mul_mat(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        let (an, bn) = (a.ne(), b.ne());
        if an[0] != bn[0]
            || bn[2] % an[2].max(1) != 0
            || bn[3] % an[3].max(1) != 0
            || an[2] == 0
            || an[3] == 0
        {
            return Err(bad("mul_mat", format!("cannot multiply {an:?} by {bn:?}")));
        }
        // SAFETY: ggml_is_transposed is a pure query.
        if unsafe { sys::ggml_is_transposed(a.raw()) } {
            return Err(bad(
                "mul_mat",
                "the first operand is transposed; make it contiguous".into(),
            ));
        }
        // SAFETY: shapes checked.
        self.op("mul_mat", 1, |c| unsafe {
            sys::ggml_mul_mat(c, a.raw(), b.raw())
        })
    }

    /// A linear layer: `weight` `[K, M]` times `x` `[K, ...]` plus `bias` (`[M]`, broadcast),
    /// the result `[M, ...]`. With [`Context::set_host_kernels`] and
    /// [`Context::set_f32_products`] on, a weight of f16 or f32 and a contiguous f32 `x` of
    /// at least 512 columns (the product of its outer dimensions) take this crate's CPU
    /// kernel (`host_linear.rs`: one custom op, f32 products on the `gemm` crate, the bias
    /// added on the way; [`LINEAR_HOST_NAME`]); else `mul_mat` then `add`.
    pub fn linear(&self, weight: &GTensor, x: &GTensor, bias: Option<&GTensor>) -> Result<GTensor> {
        let (wn, xn) = (weight.ne(), x.ne());
        let bias_ok = bias.is_none_or(|b| {
            b.dtype() == Some(DType::F32) && b.is_contiguous() && b.nelements() == wn[1]
        });
        let host = self.host_kernels()
            && self.f32_products()
            && bias_ok
            && super::host_linear::covers(
                wn,
                weight.dtype(),
                weight.is_contiguous(),
                xn,
                x.dtype() == Some(DType::F32) && x.is_contiguous(),
            );
        if !host {
            let y = self.mul_mat(weight, x)?;
            return match bias {
                Some(b) => self.add(&y, b),
                None => Ok(y),
            };
        }
        // SAFETY: shapes, types and strides checked (`covers`, the bias above); one op.
        self.op("linear", 1, |c| unsafe {
            let mut args = [
                x.raw(),
                weight.raw(),
                bias.map_or(std::ptr::null_mut(), |b| b.raw()),
            ];
            sys::ggml_custom_4d(
                c,
                sys::GGML_TYPE_F32,
                wn[1] as i64,
                xn[1] as i64,
                xn[2] as i64,
                xn[3] as i64,
                args.as_mut_ptr(),
                if bias.is_some() { 3 } else { 2 },
                Some(super::host_linear::linear_kernel),
                sys::GGML_N_TASKS_MAX,
                std::ptr::null_mut(),
            )
        })
        .inspect(|t| {
            t.set_name(LINEAR_HOST_NAME);
        })
    }

    /// Sets the accumulation precision of a matmul or attention result.
    pub fn set_precision(&self, t: &GTensor, p: Precision) {
        if p == Precision::F32 && (t.op_code() == sys::GGML_OP_MUL_MAT) {
            let _g = self.lock();
            // SAFETY: t is a MUL_MAT result.
            unsafe { sys::ggml_mul_mat_set_prec(t.raw(), sys::GGML_PREC_F32) };
        }
    }

    /// Layer normalisation over `ne[0]` (no affine part).
    pub fn norm(&self, a: &GTensor, eps: f32) -> Result<GTensor> {
        // SAFETY: float tensor.
        self.op("norm", 1, |c| unsafe { sys::ggml_norm(c, a.raw(), eps) })
    }

    /// RMS normalisation over `ne[0]`.
    pub fn rms_norm(&self, a: &GTensor, eps: f32) -> Result<GTensor> {
        // SAFETY: float tensor.
        self.op("rms_norm", 1, |c| unsafe {
            sys::ggml_rms_norm(c, a.raw(), eps)
        })
    }

    /// Group normalisation of a `[W, H, C, N]` tensor over `groups` channel groups.
    pub fn group_norm(&self, a: &GTensor, groups: usize, eps: f32) -> Result<GTensor> {
        let ne = a.ne();
        if groups == 0 || !ne[2].is_multiple_of(groups) {
            return Err(bad(
                "group_norm",
                format!("{} channels do not split into {groups} groups", ne[2]),
            ));
        }
        // SAFETY: checked.
        self.op("group_norm", 1, |c| unsafe {
            sys::ggml_group_norm(c, a.raw(), groups as i32, eps)
        })
    }

    /// Softmax over `ne[0]`.
    pub fn soft_max(&self, a: &GTensor) -> Result<GTensor> {
        // SAFETY: float tensor.
        self.op("soft_max", 1, |c| unsafe { sys::ggml_soft_max(c, a.raw()) })
    }

    /// `softmax(a * scale + mask)` with an optional mask broadcast over heads.
    pub fn soft_max_ext(&self, a: &GTensor, mask: Option<&GTensor>, scale: f32) -> Result<GTensor> {
        if let Some(m) = mask {
            let (an, mn) = (a.ne(), m.ne());
            if mn[0] != an[0]
                || mn[1] < an[1]
                || an[2] % mn[2].max(1) != 0
                || an[3] % mn[3].max(1) != 0
            {
                return Err(bad(
                    "soft_max_ext",
                    format!("mask {mn:?} does not fit scores {an:?}"),
                ));
            }
        }
        let m = mask.map_or(std::ptr::null_mut(), |m| m.raw());
        // SAFETY: checked.
        self.op("soft_max_ext", 1, |c| unsafe {
            sys::ggml_soft_max_ext(c, a.raw(), m, scale, 0.0)
        })
    }

    /// Fused attention. `q` is `[d, n_q, heads, batch]`, `k` `[d, n_kv, heads_kv, batch]`,
    /// `v` `[d_v, n_kv, heads_kv, batch]`; the result is `[d_v, heads, n_q, batch]`.
    pub fn flash_attn_ext(
        &self,
        q: &GTensor,
        k: &GTensor,
        v: &GTensor,
        mask: Option<&GTensor>,
        scale: f32,
    ) -> Result<GTensor> {
        let (qn, kn, vn) = (q.ne(), k.ne(), v.ne());
        if qn[0] != kn[0]
            || kn[1] != vn[1]
            || kn[2] != vn[2]
            || kn[2] == 0
            || qn[2] % kn[2] != 0
            || qn[3] != kn[3]
        {
            return Err(bad(
                "flash_attn_ext",
                format!("q {qn:?}, k {kn:?}, v {vn:?} do not fit"),
            ));
        }
        if let Some(m) = mask {
            let mn = m.ne();
            if mn[0] != kn[1] || mn[1] < qn[1] {
                return Err(bad(
                    "flash_attn_ext",
                    format!("mask {mn:?} does not fit q {qn:?} / k {kn:?}"),
                ));
            }
        }
        let m = mask.map_or(std::ptr::null_mut(), |m| m.raw());
        // SAFETY: checked.
        self.op("flash_attn_ext", 1, |c| unsafe {
            sys::ggml_flash_attn_ext(c, q.raw(), k.raw(), v.raw(), m, scale, 0.0, 0.0)
        })
    }

    /// Scaled dot-product attention over `heads` heads on this crate's CPU kernel (a ggml
    /// custom op, see `host_attention.rs`; only the CPU backend runs it): `q`
    /// `[heads * d, n_q, B]`, `k` `[heads * d, n_kv, B]`, `v` `[heads * dv, n_kv, B]`, f32
    /// with contiguous rows (any row and batch strides: the heads are read in place);
    /// returns `softmax(scale q k^T) v` as `[heads * dv, n_q, B]`. `None` when the operands
    /// are not of that form (the caller uses ggml's attention).
    pub fn attention_host(
        &self,
        q: &GTensor,
        k: &GTensor,
        v: &GTensor,
        heads: usize,
        scale: f32,
    ) -> Result<Option<GTensor>> {
        let (qn, kn, vn) = (q.ne(), k.ne(), v.ne());
        let rows_f32 = |t: &GTensor| {
            let nb = t.nb();
            t.dtype() == Some(DType::F32)
                && nb[0] == 4
                && nb[1].is_multiple_of(4)
                && nb[2].is_multiple_of(4)
        };
        let fits = heads > 0
            && heads < 1 << 31
            && qn[0].is_multiple_of(heads)
            && vn[0].is_multiple_of(heads)
            && qn[0] == kn[0]
            && kn[1] == vn[1]
            && qn[2] == kn[2]
            && kn[2] == vn[2]
            && qn[3] == 1
            && kn[3] == 1
            && vn[3] == 1
            && qn[1] > 0
            && kn[1] > 0
            && [q, k, v].into_iter().all(rows_f32);
        if !fits {
            return Ok(None);
        }
        let spec = super::host_attention::AttentionSpec {
            heads: heads as u32,
            scale,
            bf16: self.bf16_attention()
                && (qn[0] / heads).is_multiple_of(2)
                && super::host_attention::bf16_available(),
        };
        // SAFETY: shapes, types and strides checked.
        unsafe {
            self.host_kernel_op(
                ATTENTION_HOST_NAME,
                [vn[0], qn[1], qn[2], 1],
                &[q, k, v],
                Some(super::host_attention::attention_kernel),
                spec.pack(),
            )
        }
        .map(Some)
    }

    /// The gated GELU of a feed-forward layer on this crate's CPU kernel (a ggml custom op,
    /// see `host_geglu.rs`; only the CPU backend runs it): `p` `[2 I, N1, N2, N3]` f32 with
    /// contiguous rows gives `[I, N1, N2, N3]`, each row's first `I` values times the exact
    /// (erf) GELU of its last `I` ([`GEGLU_HOST_NAME`]). `None` without
    /// [`Context::set_host_kernels`] or when `p` is not of that form (the caller uses
    /// ggml's ops).
    pub fn geglu_host(&self, p: &GTensor) -> Result<Option<GTensor>> {
        let (ne, nb) = (p.ne(), p.nb());
        let fits = self.host_kernels()
            && p.dtype() == Some(DType::F32)
            && nb[0] == 4
            && ne[0] > 0
            && ne[0].is_multiple_of(2)
            && nb[1..].iter().all(|b| b.is_multiple_of(4));
        if !fits {
            return Ok(None);
        }
        // SAFETY: shape, type and strides checked.
        unsafe {
            self.host_kernel_op(
                GEGLU_HOST_NAME,
                [ne[0] / 2, ne[1], ne[2], ne[3]],
                &[p],
                Some(super::host_geglu::geglu_kernel),
                0,
            )
        }
        .map(Some)
    }

    /// GELU's tanh form on this crate's CPU kernel (a ggml custom op, see
    /// `host_gelu_tanh.rs`; only the CPU backend runs it), in f32 to a few ulp of the
    /// formula: `gelu(x)`, or `gelu(x) * times` ([`GELU_TANH_HOST_NAME`]). `x` and `times`
    /// f32 of one shape with contiguous rows (any row strides: a view of a projection's
    /// rows will do); the result is contiguous. `None` without
    /// [`Context::set_host_kernels`] or when the operands are not of that form (the caller
    /// uses ggml's ops).
    pub fn gelu_tanh_host(&self, x: &GTensor, times: Option<&GTensor>) -> Result<Option<GTensor>> {
        let fits = |t: &GTensor| {
            t.dtype() == Some(DType::F32)
                && t.nb()[0] == 4
                && t.nb()[1..].iter().all(|b| b.is_multiple_of(4))
                && t.ne() == x.ne()
        };
        if !self.host_kernels() || x.nelements() == 0 || !fits(x) || !times.is_none_or(fits) {
            return Ok(None);
        }
        let args: Vec<&GTensor> = std::iter::once(x).chain(times).collect();
        // SAFETY: shapes, types and strides checked.
        unsafe {
            self.host_kernel_op(
                GELU_TANH_HOST_NAME,
                x.ne(),
                &args,
                Some(super::host_gelu_tanh::gelu_tanh_kernel),
                0,
            )
        }
        .map(Some)
    }

    /// With this crate's CPU kernels ([`Context::set_host_kernels`]): a group norm of `x`
    /// `[W, H, C, N]` (f32, contiguous) over `groups` groups of channels with `eps`, times
    /// the `C` `scale`s plus the `shift`s per channel, then with `silu` its SiLU, in one
    /// op ([`GROUP_NORM_HOST_NAME`]). `None` without host kernels or when the operands are
    /// not of that form (the caller uses ggml's ops); an error when the channels do not
    /// split into `groups`.
    pub fn group_norm_host(
        &self,
        x: &GTensor,
        groups: usize,
        eps: f32,
        scale: &GTensor,
        shift: &GTensor,
        silu: bool,
    ) -> Result<Option<GTensor>> {
        let ne = x.ne();
        if groups == 0 || groups > 0x7fff_ffff || !ne[2].is_multiple_of(groups) {
            return Err(bad(
                "group_norm_host",
                format!("{} channels do not split into {groups} groups", ne[2]),
            ));
        }
        let affine_ok = |t: &GTensor| {
            t.dtype() == Some(DType::F32) && t.is_contiguous() && t.nelements() == ne[2]
        };
        let fits = self.host_kernels()
            && x.dtype() == Some(DType::F32)
            && x.is_contiguous()
            && affine_ok(scale)
            && affine_ok(shift);
        if !fits {
            return Ok(None);
        }
        let spec = super::host_group_norm::GroupNormSpec {
            groups: groups as u32,
            silu,
            eps,
        };
        // SAFETY: shapes, types and contiguity checked.
        unsafe {
            self.host_kernel_op(
                GROUP_NORM_HOST_NAME,
                ne,
                &[x, scale, shift],
                Some(super::host_group_norm::group_norm_kernel),
                spec.pack(),
            )
        }
        .map(Some)
    }

    /// A reshaped view of a contiguous tensor with ggml dims `ne`.
    pub fn reshape(&self, a: &GTensor, ne: &[usize]) -> Result<GTensor> {
        let n: usize = ne.iter().product();
        if ne.is_empty() || ne.len() > 4 || n != a.nelements() {
            return Err(bad(
                "reshape",
                format!("{:?} ({} elements) to {ne:?}", a.ne(), a.nelements()),
            ));
        }
        if !a.is_contiguous() {
            return Err(bad("reshape", "source is not contiguous".into()));
        }
        let d = |i: usize| *ne.get(i).unwrap_or(&1) as i64;
        // SAFETY: element count and contiguity checked.
        self.op("reshape", 1, |c| unsafe {
            match ne.len() {
                1 => sys::ggml_reshape_1d(c, a.raw(), d(0)),
                2 => sys::ggml_reshape_2d(c, a.raw(), d(0), d(1)),
                3 => sys::ggml_reshape_3d(c, a.raw(), d(0), d(1), d(2)),
                _ => sys::ggml_reshape_4d(c, a.raw(), d(0), d(1), d(2), d(3)),
            }
        })
    }

    /// A strided view of `a`: dims `ne`, byte strides `nb[1..]` (`nb[0]` is the element size),
    /// starting `offset` bytes in.
    pub fn view(
        &self,
        a: &GTensor,
        ne: [usize; 4],
        nb: [usize; 3],
        offset: usize,
    ) -> Result<GTensor> {
        let dtype = a
            .dtype()
            .ok_or_else(|| bad("view", "unknown type".into()))?;
        let row = dtype
            .row_size(ne[0])
            .ok_or_else(|| bad("view", "partial block".into()))?;
        // The last byte touched must be inside the source.
        let mut end = offset.checked_add(row);
        for (i, &stride) in nb.iter().enumerate() {
            if ne[i + 1] > 0 {
                end = end.and_then(|e| {
                    stride
                        .checked_mul(ne[i + 1] - 1)
                        .and_then(|x| e.checked_add(x))
                });
            }
        }
        if ne.contains(&0) || end.is_none_or(|e| e > a.nbytes()) {
            return Err(bad(
                "view",
                format!(
                    "view {ne:?} at {offset} exceeds {} bytes of {:?}",
                    a.nbytes(),
                    a.ne()
                ),
            ));
        }
        // ggml checks a view's *contiguous* size (row size times the outer dims) against the
        // source; a view whose strides overlap (an im2col-like window) can exceed it while
        // touching only bytes inside. Such a view is created as a one-row view and given its
        // dims and strides afterwards.
        let contiguous_size = ne[1..].iter().try_fold(row, |acc, &d| acc.checked_mul(d));
        let overlapping = contiguous_size
            .and_then(|s| s.checked_add(offset))
            .is_none_or(|e| e > a.nbytes());
        // SAFETY: bounds checked (the last byte touched is inside the source); an
        // overlapping view's fields are set to dims and strides whose extent was checked.
        self.op("view", 1, |c| unsafe {
            if overlapping {
                let t = sys::ggml_view_1d(c, a.raw(), ne[0] as i64, offset);
                if !t.is_null() {
                    for i in 1..4 {
                        (*t).ne[i] = ne[i] as i64;
                        (*t).nb[i] = nb[i - 1];
                    }
                }
                t
            } else {
                sys::ggml_view_4d(
                    c,
                    a.raw(),
                    ne[0] as i64,
                    ne[1] as i64,
                    ne[2] as i64,
                    ne[3] as i64,
                    nb[0],
                    nb[1],
                    nb[2],
                    offset,
                )
            }
        })
    }

    /// Permutes dims: source axis `i` becomes result axis `axes[i]`.
    pub fn permute(&self, a: &GTensor, axes: [usize; 4]) -> Result<GTensor> {
        let mut seen = [false; 4];
        for &x in &axes {
            if x >= 4 || seen[x] {
                return Err(bad("permute", format!("{axes:?} is not a permutation")));
            }
            seen[x] = true;
        }
        // SAFETY: valid permutation.
        self.op("permute", 1, |c| unsafe {
            sys::ggml_permute(
                c,
                a.raw(),
                axes[0] as i32,
                axes[1] as i32,
                axes[2] as i32,
                axes[3] as i32,
            )
        })
    }

    /// Swaps dims 0 and 1 (a view).
    pub fn transpose(&self, a: &GTensor) -> Result<GTensor> {
        // SAFETY: any tensor.
        self.op("transpose", 1, |c| unsafe {
            sys::ggml_transpose(c, a.raw())
        })
    }

    /// Concatenates along `dim`.
    pub fn concat(&self, a: &GTensor, b: &GTensor, dim: usize) -> Result<GTensor> {
        let (an, bn) = (a.ne(), b.ne());
        if dim >= 4 || (0..4).any(|i| i != dim && an[i] != bn[i]) || a.dtype() != b.dtype() {
            return Err(bad("concat", format!("{an:?} and {bn:?} along {dim}")));
        }
        // SAFETY: checked.
        self.op("concat", 1, |c| unsafe {
            sys::ggml_concat(c, a.raw(), b.raw(), dim as i32)
        })
    }

    /// Copies `a` into `b` (converting type); the result is a view of `b`.
    pub fn cpy(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        if a.nelements() != b.nelements() {
            return Err(bad("cpy", format!("{:?} into {:?}", a.ne(), b.ne())));
        }
        // SAFETY: checked.
        self.op("cpy", 1, |c| unsafe { sys::ggml_cpy(c, a.raw(), b.raw()) })
    }

    /// Converts to `dtype` (f32, f16, bf16).
    pub fn cast(&self, a: &GTensor, dtype: DType) -> Result<GTensor> {
        // SAFETY: ggml_cast creates a cpy to a new tensor.
        self.op("cast", 2, |c| unsafe {
            sys::ggml_cast(c, a.raw(), dtype.to_ggml())
        })
    }

    /// Repeats `a` to the shape of `b`.
    pub fn repeat(&self, a: &GTensor, b: &GTensor) -> Result<GTensor> {
        if !can_repeat(a, b) {
            return Err(bad(
                "repeat",
                format!("{:?} does not tile {:?}", a.ne(), b.ne()),
            ));
        }
        // SAFETY: checked.
        self.op("repeat", 1, |c| unsafe {
            sys::ggml_repeat(c, a.raw(), b.raw())
        })
    }

    /// Rows of `a` selected by the I32 indices `ids`.
    pub fn get_rows(&self, a: &GTensor, ids: &GTensor) -> Result<GTensor> {
        if ids.dtype() != Some(DType::I32) || ids.ne()[2] != a.ne()[2] && a.ne()[2] != 1 {
            return Err(bad(
                "get_rows",
                format!(
                    "ids {:?} {:?} for rows of {:?}",
                    ids.dtype(),
                    ids.ne(),
                    a.ne()
                ),
            ));
        }
        // SAFETY: checked.
        self.op("get_rows", 1, |c| unsafe {
            sys::ggml_get_rows(c, a.raw(), ids.raw())
        })
    }

    /// 2-D convolution of `input` `[W, H, C, N]` with `kernel` `[KW, KH, C, OC]`, computed as
    /// im2col + matmul. `exact_f32` keeps the im2col in f32 (ggml's default is f16).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d(
        &self,
        kernel: &GTensor,
        input: &GTensor,
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
        exact_f32: bool,
    ) -> Result<GTensor> {
        let (kn, xn) = (kernel.ne(), input.ne());
        let (ow, oh) = self.check_conv(kn, xn, stride, pad, dilation)?;
        // Bands pad f32 activations (ggml's CUDA padding takes f32 only).
        let limit = self
            .band_bytes()
            .filter(|_| input.dtype() == Some(DType::F32));
        if let Some(limit) = limit {
            let esz = match ggml_im2col_type(kernel.dtype(), exact_f32, false) {
                sys::GGML_TYPE_F32 => 4,
                _ => 2,
            };
            let row_bytes = kn[0] * kn[1] * kn[2] * ow * xn[3] * esz;
            let whole = row_bytes * oh;
            if oh >= 2 && whole > limit {
                // Equal bands, as few as keep each within the limit.
                let bands = whole.div_ceil(limit.max(1)).min(oh);
                let rows = oh.div_ceil(bands);
                // Banding costs the padded copy of the input (when there is padding) and
                // the bands' outputs beside their concatenation: only where the im2col
                // saves more.
                let f32_bytes = DType::F32.type_size();
                let padded = if pad.1 > 0 || !input.is_contiguous() {
                    xn[0] * (xn[1] + 2 * pad.1) * xn[2] * xn[3] * f32_bytes
                } else {
                    0
                };
                let out = ow * oh * kn[3] * xn[3] * f32_bytes;
                if whole - row_bytes * rows > padded + out {
                    return self
                        .conv_2d_bands(kernel, input, stride, pad, dilation, exact_f32, oh, rows);
                }
            }
        }
        self.conv_2d_with(kernel, input, None, stride, pad, dilation, exact_f32, false)
    }

    /// [`conv_2d`](Self::conv_2d) (checked, `oh` output rows) in bands of at most `rows`
    /// output rows: the input padded in height once, each band an unpadded-in-height
    /// convolution of the rows it reads (a view), the bands concatenated along the rows.
    #[allow(clippy::too_many_arguments)]
    fn conv_2d_bands(
        &self,
        kernel: &GTensor,
        input: &GTensor,
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
        exact_f32: bool,
        oh: usize,
        rows: usize,
    ) -> Result<GTensor> {
        let (kn, xn) = (kernel.ne(), input.ne());
        let ext_h = dilation.1 * (kn[1] - 1) + 1;
        let padded = if pad.1 > 0 {
            self.pad_ext(input, [(0, 0), (pad.1, pad.1), (0, 0), (0, 0)])?
        } else if input.is_contiguous() {
            input.clone()
        } else {
            self.cont(input)?
        };
        let nb = padded.nb();
        let mut out: Option<GTensor> = None;
        let mut o0 = 0;
        while o0 < oh {
            let o1 = (o0 + rows).min(oh);
            let first = o0 * stride.1;
            let count = (o1 - o0 - 1) * stride.1 + ext_h;
            let band = self.view(
                &padded,
                [xn[0], count, xn[2], xn[3]],
                [nb[1], nb[2], nb[3]],
                first * nb[1],
            )?;
            let y = self.conv_2d_with(
                kernel,
                &band,
                None,
                stride,
                (pad.0, 0),
                dilation,
                exact_f32,
                false,
            )?;
            out = Some(match out {
                None => y,
                Some(o) => self.concat(&o, &y, 1)?,
            });
            o0 = o1;
        }
        out.ok_or_else(|| bad("conv_2d", "no output rows".into()))
    }

    /// [`conv_2d`](Self::conv_2d) plus `bias` (`[OC]` f32, added per output channel), with the
    /// im2col and the epilogue (layout and bias) done by this crate's CPU kernels (ggml
    /// custom ops, see `host_conv.rs`): the same bits as `conv_2d` followed by a broadcast
    /// `add`, several times faster in those steps. Only the CPU backend runs custom ops:
    /// use it for graphs computed there. Inputs the im2col kernel does not cover (not f32
    /// with contiguous rows, a geometry over 255) take ggml's im2col.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_host(
        &self,
        kernel: &GTensor,
        input: &GTensor,
        bias: Option<&GTensor>,
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
        exact_f32: bool,
    ) -> Result<GTensor> {
        if let Some(b) = bias {
            // f32, as ggml's CPU `add` takes it.
            let f32 = b.dtype() == Some(DType::F32);
            if b.nelements() != kernel.ne()[3] || !f32 || !b.is_contiguous() {
                return Err(bad(
                    "conv_2d",
                    format!("bias {:?} for kernel {:?}", b.ne(), kernel.ne()),
                ));
            }
        }
        self.conv_2d_with(kernel, input, bias, stride, pad, dilation, exact_f32, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn conv_2d_with(
        &self,
        kernel: &GTensor,
        input: &GTensor,
        bias: Option<&GTensor>,
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
        exact_f32: bool,
        host_kernels: bool,
    ) -> Result<GTensor> {
        let (kn, xn) = (kernel.ne(), input.ne());
        self.check_conv(kn, xn, stride, pad, dilation)?;
        let (s0, s1, p0, p1, d0, d1) = (
            stride.0 as i32,
            stride.1 as i32,
            pad.0 as i32,
            pad.1 as i32,
            dilation.0 as i32,
            dilation.1 as i32,
        );
        // The host kernel's geometry and output size, when it covers this convolution.
        let host = host_kernels
            .then(|| {
                let g =
                    super::host_conv::Im2colGeometry::new(stride, pad, dilation, (kn[0], kn[1]))?;
                let (ow, oh) = g.output_size(xn[0], xn[1])?;
                let rows_contiguous = input.nb()[0] == 4;
                (input.dtype() == Some(DType::F32) && rows_contiguous).then_some((g, ow, oh))
            })
            .flatten();
        let im2col_type = ggml_im2col_type(kernel.dtype(), exact_f32, host.is_some());
        // One custom op computing the convolution from the input itself with `fun` (the
        // im2col geometry packed as its userdata), named `name`; the callers check shapes,
        // types and strides for `fun` first.
        let implicit_op =
            |fun: sys::ggml_custom_op_t, geometry: usize, out: [usize; 4], name: &str| {
                // SAFETY: `fun` covers these shapes (checked by the callers); one custom op.
                self.op("conv_2d", 1, |c| unsafe {
                    conv_output_op(c, input.raw(), kernel, bias, out, fun, geometry)
                })
                .inspect(|t| {
                    t.set_name(name);
                })
            };
        // Stride-1 convolutions of f16 / f32 kernels over large enough images: products over
        // shifted views of the padded input, no im2col (see `host_conv_implicit.rs`).
        if let Some((g, ow, oh)) = host {
            let implicit = host_kernels
                && self.f32_products()
                && super::host_conv_implicit::covers(
                    kn,
                    kernel.dtype(),
                    kernel.is_contiguous(),
                    xn,
                    g,
                );
            if implicit {
                // Shapes, types and strides checked (`covers`, `check_conv`, the bias's in
                // `conv_2d_host`).
                return implicit_op(
                    Some(super::host_conv_implicit::implicit_conv_kernel),
                    g.pack(),
                    [ow, oh, kn[3], xn[3]],
                    IMPLICIT_CONV_NAME,
                );
            }
        }
        // bf16 kernels on AMX tiles: this crate's bf16 im2col, then one op for the product,
        // the layout and the bias (see `host_amx.rs`).
        #[cfg(target_arch = "x86_64")]
        if let Some((g, ow, oh)) = host {
            let k = kn[0] * kn[1] * kn[2];
            let bf16 = kernel.dtype() == Some(DType::BF16) && kernel.is_contiguous();
            if bf16 && self.f32_products() && super::host_amx::covers_implicit(kn, xn, g) {
                // Shapes and types checked (`check_conv`, `covers_implicit`, the bias's in
                // `conv_2d_host`).
                return implicit_op(
                    Some(super::host_amx::implicit_conv_kernel),
                    g.pack(),
                    [ow, oh, kn[3], xn[3]],
                    TILE_CONV_NAME,
                );
            }
            if bf16 && self.f32_products() && super::host_amx::covers(k, kn[3], true) {
                // SAFETY: shapes and types checked (`check_conv`, `covers`, the bias's in
                // `conv_2d_host`); two custom ops.
                return self
                    .op("conv_2d", 2, |c| unsafe {
                        let im = host_im2col(c, input, sys::GGML_TYPE_BF16, [k, ow, oh, xn[3]], g);
                        conv_output_op(
                            c,
                            im,
                            kernel,
                            bias,
                            [ow, oh, kn[3], xn[3]],
                            Some(super::host_amx::conv_kernel),
                            0,
                        )
                    })
                    .inspect(|t| {
                        t.set_name(TILE_CONV_NAME);
                    });
            }
        }
        // f16 kernels the implicit kernel does not take (strided, narrow images): this crate's
        // f32 im2col, then one op for the f32 product, the layout and the bias (see
        // `host_linear.rs`).
        if let Some((g, ow, oh)) = host {
            let k = kn[0] * kn[1] * kn[2];
            if self.f32_products()
                && super::host_linear::covers_conv(
                    kernel.dtype(),
                    kernel.is_contiguous(),
                    k,
                    kn[3],
                    ow * oh * xn[3],
                )
            {
                // SAFETY: shapes and types checked (`check_conv`, `covers_conv`, the bias's
                // in `conv_2d_host`); two custom ops.
                return self
                    .op("conv_2d", 2, |c| unsafe {
                        let im = host_im2col(c, input, sys::GGML_TYPE_F32, [k, ow, oh, xn[3]], g);
                        conv_output_op(
                            c,
                            im,
                            kernel,
                            bias,
                            [ow, oh, kn[3], xn[3]],
                            Some(super::host_linear::conv_kernel),
                            0,
                        )
                    })
                    .inspect(|t| {
                        t.set_name(IM2COL_CONV_NAME);
                    });
            }
        }
        // SAFETY: shapes checked; im2col + reshapes + per image a view, a product and a
        // reshape, the concatenations (or the host epilogue) = at most 4 + 4 N tensors.
        self.op("conv_2d", 4 + 4 * xn[3].max(1), |c| unsafe {
            let im = match host {
                Some((g, ow, oh)) => host_im2col(
                    c,
                    input,
                    im2col_type,
                    [kn[0] * kn[1] * kn[2], ow, oh, xn[3]],
                    g,
                ),
                None => sys::ggml_im2col(
                    c,
                    kernel.raw(),
                    input.raw(),
                    s0,
                    s1,
                    p0,
                    p1,
                    d0,
                    d1,
                    true,
                    im2col_type,
                ),
            };
            // im: [IC*KH*KW, OW, OH, N]
            let imn = (*im).ne;
            let k2 = sys::ggml_reshape_2d(
                c,
                kernel.raw(),
                kn[0] as i64 * kn[1] as i64 * kn[2] as i64,
                kn[3] as i64,
            );
            if host_kernels {
                let im2 = sys::ggml_reshape_2d(c, im, imn[0], imn[3] * imn[2] * imn[1]);
                let r = sys::ggml_mul_mat(c, im2, k2); // [N*OH*OW, OC]
                                                       // Layout and bias in one pass (see `host_conv.rs`).
                let mut args = [r, bias.map_or(std::ptr::null_mut(), |b| b.raw())];
                return sys::ggml_custom_4d(
                    c,
                    sys::GGML_TYPE_F32,
                    imn[1],
                    imn[2],
                    kn[3] as i64,
                    imn[3],
                    args.as_mut_ptr(),
                    if bias.is_some() { 2 } else { 1 },
                    Some(super::host_conv::epilogue_kernel),
                    sys::GGML_N_TASKS_MAX,
                    std::ptr::null_mut(),
                );
            }
            // One product per image: each gives [OW*OH, OC], the image's [OW, OH, OC] layout,
            // and the images are concatenated (a contiguous copy; none for one image)
            // instead of permuting [OW, OH, N, OC] (a strided copy, ggml's slowest on CUDA).
            let per_image = |n: i64| {
                let v = sys::ggml_view_2d(
                    c,
                    im,
                    imn[0],
                    imn[1] * imn[2],
                    (*im).nb[1],
                    n as usize * (*im).nb[3],
                );
                let r = sys::ggml_mul_mat(c, v, k2); // [OW*OH, OC]
                sys::ggml_reshape_4d(c, r, imn[1], imn[2], kn[3] as i64, 1)
            };
            let mut out = per_image(0);
            for n in 1..imn[3] {
                out = sys::ggml_concat(c, out, per_image(n), 3);
            }
            out
        })
    }

    /// `x` `[W, H, C, N]` (f32) times `scale` plus `shift`, per channel: each `None` or `C`
    /// values (`[C]`) or `C * N` (`[C, N]`, one set per sample), f32. With
    /// [`Context::set_host_kernels`] on, one pass of this crate's CPU kernel (a ggml custom
    /// op, see `host_conv.rs`) when `x` is contiguous; else ggml's broadcast `mul` then `add`.
    /// The same bits either way.
    pub fn channel_affine(
        &self,
        x: &GTensor,
        scale: Option<&GTensor>,
        shift: Option<&GTensor>,
    ) -> Result<GTensor> {
        let [_, _, c, n] = x.ne();
        for t in [scale, shift].into_iter().flatten() {
            let k = t.nelements();
            if t.dtype() != Some(DType::F32) || !t.is_contiguous() || (k != c && k != c * n) {
                return Err(bad(
                    "channel_affine",
                    format!("{:?} for an input {:?}", t.ne(), x.ne()),
                ));
            }
        }
        let as_channels = |t: &GTensor| {
            let per_sample = if t.nelements() == c { 1 } else { n };
            self.reshape(t, &[1, 1, c, per_sample])
        };
        if !(self.host_kernels() && x.dtype() == Some(DType::F32) && x.is_contiguous()) {
            let mut y = x.clone();
            if let Some(s) = scale {
                y = self.mul(&y, &as_channels(s)?)?;
            }
            if let Some(b) = shift {
                y = self.add(&y, &as_channels(b)?)?;
            }
            return Ok(y);
        }
        let mut args = [
            x.raw(),
            scale.map_or(std::ptr::null_mut(), |t| t.raw()),
            shift.map_or(std::ptr::null_mut(), |t| t.raw()),
        ];
        // SAFETY: shapes and types checked (the kernel takes null scale and shift).
        unsafe {
            self.custom_f32(
                "channel_affine",
                x.ne(),
                &mut args,
                Some(super::host_conv::channel_affine_kernel),
                0,
            )
        }
    }

    /// The "same" convolution (stride 1, zero padding `p = (k - 1) / 2`) of channels-innermost
    /// activations: `pieces`, each `[C_j, W + 2p, H + 2p, 1]` f32, already zero-padded,
    /// are the input's channels in order (a concatenation never built); `kernel`
    /// `[k, k, sum C_j, OC]` f32 with `k` odd; `bias` `[OC]` f32 added per output channel;
    /// `leaky_slope` a LeakyReLU after it. Returns `[OC, W, H, 1]`, or with `padded_out`
    /// `[OC, W + 2p, H + 2p, 1]` with a zero border of `p` (the next convolution's piece).
    ///
    /// With [`Context::set_host_kernels`] on and every operand f32 and contiguous, one
    /// custom op of this crate (`host_conv_cwh.rs`: matrix products straight over the padded
    /// input, no im2col, no concatenation); otherwise ggml's ops (the pieces concatenated,
    /// each kernel row's windows copied, one batched product). Both agree to f32 rounding.
    pub fn conv_2d_cwh(
        &self,
        kernel: &GTensor,
        pieces: &[&GTensor],
        bias: Option<&GTensor>,
        leaky_slope: Option<f32>,
        padded_out: bool,
    ) -> Result<GTensor> {
        use super::host_conv_cwh::{CwhSpec, FIXED_SOURCES};
        let [kw, kh, c, oc] = kernel.ne();
        let Some(first) = pieces.first() else {
            return Err(bad("conv_2d_cwh", "no input".into()));
        };
        let [_, pw, ph, _] = GTensor::ne(first);
        let pad = kw.saturating_sub(1) / 2;
        let channels: usize = pieces.iter().map(|p| GTensor::ne(p)[0]).sum();
        let shapes_agree = pieces
            .iter()
            .all(|p| GTensor::ne(p)[1..] == [pw, ph, 1] && GTensor::ne(p)[0] > 0);
        if kw != kh
            || kw.is_multiple_of(2)
            || kw > 255
            || channels != c
            || !shapes_agree
            || pw <= 2 * pad
            || ph <= 2 * pad
        {
            let got: Vec<[usize; 4]> = pieces.iter().map(|p| GTensor::ne(p)).collect();
            return Err(bad(
                "conv_2d_cwh",
                format!("kernel {:?} on padded pieces {got:?}", kernel.ne()),
            ));
        }
        if let Some(b) = bias {
            if b.nelements() != oc || b.dtype() != Some(DType::F32) || !b.is_contiguous() {
                return Err(bad(
                    "conv_2d_cwh",
                    format!("bias {:?} for kernel {:?}", b.ne(), kernel.ne()),
                ));
            }
        }
        let (w, h) = (pw - 2 * pad, ph - 2 * pad);
        let f32_contiguous = |t: &GTensor| t.dtype() == Some(DType::F32) && t.is_contiguous();
        let host = self.host_kernels()
            && f32_contiguous(kernel)
            && pieces.iter().all(|p| f32_contiguous(p))
            && pieces.len() + FIXED_SOURCES < sys::GGML_MAX_SRC as usize;
        if !host {
            return self.conv_2d_cwh_ops(kernel, pieces, bias, leaky_slope, padded_out, w, h);
        }
        let spec = CwhSpec {
            kernel: kw as u8,
            padded_out,
            leaky_slope,
        };
        let (ow, oh) = if padded_out { (pw, ph) } else { (w, h) };
        // SAFETY: shapes and types checked; one tensor.
        self.op("conv_2d_cwh", 1, |ctx| unsafe {
            let mut args = vec![kernel.raw(), bias.map_or(std::ptr::null_mut(), |b| b.raw())];
            args.extend(pieces.iter().map(|p| p.raw()));
            sys::ggml_custom_4d(
                ctx,
                sys::GGML_TYPE_F32,
                oc as i64,
                ow as i64,
                oh as i64,
                1,
                args.as_mut_ptr(),
                args.len() as i32,
                Some(super::host_conv_cwh::conv_cwh_kernel),
                sys::GGML_N_TASKS_MAX,
                spec.pack() as *mut std::ffi::c_void,
            )
        })
    }

    /// [`conv_2d_cwh`](Self::conv_2d_cwh) in ggml's ops (for other backends): concatenate
    /// the pieces; for a `k` x `k` kernel the padded input's `k` horizontally adjacent pixels
    /// are `k C` contiguous values, so one overlapping strided view `[k C, W, H, k]` (the last
    /// dim steps one padded row) copied contiguously is the im2col matrix split by kernel
    /// row; one batched product with the kernel permuted to `[k C, OC, k]` and a sum over the
    /// kernel rows finish the convolution (ggml copies such a view row by row, much faster
    /// than its element-wise im2col).
    #[allow(clippy::too_many_arguments)]
    fn conv_2d_cwh_ops(
        &self,
        kernel: &GTensor,
        pieces: &[&GTensor],
        bias: Option<&GTensor>,
        leaky_slope: Option<f32>,
        padded_out: bool,
        w: usize,
        h: usize,
    ) -> Result<GTensor> {
        let [k, _, c, oc] = kernel.ne();
        let mut xp = pieces[0].clone();
        for p in &pieces[1..] {
            xp = self.concat(&xp, p, 0)?;
        }
        if !xp.is_contiguous() {
            xp = self.cont(&xp)?;
        }
        // Kernel [kx, ky, C, OC] -> [C, kx, OC, ky] = [k C, OC, k].
        let wk = self.cont(&self.permute(kernel, [1, 3, 0, 2])?)?;
        let wk = self.reshape(&wk, &[k * c, oc, k])?;
        let nb = xp.nb();
        // [k C, W, H, k]: pixel (x, y) of kernel row ky starts at x nb1 + (y + ky) nb2.
        let cols = self.view(&xp, [k * c, w, h, k], [nb[1], nb[2], nb[2]], 0)?;
        let cols = self.reshape(&self.cont(&cols)?, &[k * c, w * h, k])?;
        let y = self.mul_mat(&wk, &cols)?; // [OC, W*H, k]
        let yn = y.nb();
        let row = |ky: usize| self.view(&y, [oc, w * h, 1, 1], [yn[1], yn[2], yn[2]], ky * yn[2]);
        let mut acc = row(0)?;
        for ky in 1..k {
            acc = self.add(&acc, &row(ky)?)?;
        }
        if !acc.is_contiguous() {
            acc = self.cont(&acc)?;
        }
        let mut out = self.reshape(&acc, &[oc, w, h, 1])?;
        if let Some(b) = bias {
            out = self.add(&out, b)?;
        }
        if let Some(a) = leaky_slope {
            out = self.leaky_relu(&out, a)?;
        }
        let pad = (k - 1) / 2;
        if padded_out && pad > 0 {
            out = self.pad_ext(&out, [(0, 0), (pad, pad), (pad, pad), (0, 0)])?;
        }
        Ok(out)
    }

    /// 2-D convolution computed directly (no im2col buffer), f32 exact.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_direct(
        &self,
        kernel: &GTensor,
        input: &GTensor,
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
    ) -> Result<GTensor> {
        self.check_conv(kernel.ne(), input.ne(), stride, pad, dilation)?;
        // SAFETY: shapes checked.
        self.op("conv_2d_direct", 1, |c| unsafe {
            sys::ggml_conv_2d_direct(
                c,
                kernel.raw(),
                input.raw(),
                stride.0 as i32,
                stride.1 as i32,
                pad.0 as i32,
                pad.1 as i32,
                dilation.0 as i32,
                dilation.1 as i32,
            )
        })
    }

    /// Checks a convolution's operands; its output width and height.
    fn check_conv(
        &self,
        kn: [usize; 4],
        xn: [usize; 4],
        stride: (usize, usize),
        pad: (usize, usize),
        dilation: (usize, usize),
    ) -> Result<(usize, usize)> {
        if kn[2] != xn[2] {
            return Err(bad(
                "conv_2d",
                format!(
                    "kernel {kn:?} expects {} channels, input {xn:?} has {}",
                    kn[2], xn[2]
                ),
            ));
        }
        if stride.0 == 0 || stride.1 == 0 || dilation.0 == 0 || dilation.1 == 0 {
            return Err(bad("conv_2d", "zero stride or dilation".into()));
        }
        let ext_w = dilation.0 * (kn[0] - 1) + 1;
        let ext_h = dilation.1 * (kn[1] - 1) + 1;
        if xn[0] + 2 * pad.0 < ext_w || xn[1] + 2 * pad.1 < ext_h {
            return Err(bad(
                "conv_2d",
                format!("kernel {kn:?} larger than padded input {xn:?}"),
            ));
        }
        Ok((
            (xn[0] + 2 * pad.0 - ext_w) / stride.0 + 1,
            (xn[1] + 2 * pad.1 - ext_h) / stride.1 + 1,
        ))
    }

    /// Resizes dims 0 and 1 to `w` x `h` (dims 2, 3 kept).
    pub fn interpolate(
        &self,
        a: &GTensor,
        w: usize,
        h: usize,
        mode: Interpolation,
    ) -> Result<GTensor> {
        if w == 0 || h == 0 {
            return Err(bad("interpolate", "zero output size".into()));
        }
        let ne = a.ne();
        let m = match mode {
            Interpolation::Nearest => sys::GGML_SCALE_MODE_NEAREST,
            Interpolation::Bilinear => sys::GGML_SCALE_MODE_BILINEAR,
            Interpolation::BilinearAlignCorners => {
                sys::GGML_SCALE_MODE_BILINEAR | sys::GGML_SCALE_FLAG_ALIGN_CORNERS
            }
        };
        // SAFETY: sizes positive.
        self.op("interpolate", 1, |c| unsafe {
            sys::ggml_interpolate(
                c,
                a.raw(),
                w as i64,
                h as i64,
                ne[2] as i64,
                ne[3] as i64,
                m,
            )
        })
    }

    /// Nearest-neighbour upscale of dims 0 and 1 by an integer factor.
    pub fn upscale(&self, a: &GTensor, factor: usize) -> Result<GTensor> {
        let ne = a.ne();
        self.interpolate(a, ne[0] * factor, ne[1] * factor, Interpolation::Nearest)
    }

    /// Pads each dim with zeros: `p[i] = (before, after)`.
    pub fn pad_ext(&self, a: &GTensor, p: [(usize, usize); 4]) -> Result<GTensor> {
        if p.iter()
            .any(|&(l, r)| l > i32::MAX as usize || r > i32::MAX as usize)
        {
            return Err(bad("pad_ext", format!("padding {p:?} too large")));
        }
        // SAFETY: non-negative pads.
        self.op("pad_ext", 1, |c| unsafe {
            sys::ggml_pad_ext(
                c,
                a.raw(),
                p[0].0 as i32,
                p[0].1 as i32,
                p[1].0 as i32,
                p[1].1 as i32,
                p[2].0 as i32,
                p[2].1 as i32,
                p[3].0 as i32,
                p[3].1 as i32,
            )
        })
    }

    /// Pads each dim at its end with zeros.
    pub fn pad(&self, a: &GTensor, p: [usize; 4]) -> Result<GTensor> {
        // SAFETY: non-negative pads.
        self.op("pad", 1, |c| unsafe {
            sys::ggml_pad(
                c,
                a.raw(),
                p[0] as i32,
                p[1] as i32,
                p[2] as i32,
                p[3] as i32,
            )
        })
    }

    /// Sinusoidal timestep embedding `[dim, N]` of timesteps `[N]`.
    pub fn timestep_embedding(&self, t: &GTensor, dim: usize, max_period: i32) -> Result<GTensor> {
        if t.dtype() != Some(DType::F32) || t.ne()[1] != 1 {
            return Err(bad(
                "timestep_embedding",
                format!("timesteps must be f32 [N], got {:?}", t.ne()),
            ));
        }
        // SAFETY: checked.
        self.op("timestep_embedding", 1, |c| unsafe {
            sys::ggml_timestep_embedding(c, t.raw(), dim as i32, max_period)
        })
    }

    /// Rotary position embedding of sections with their own positions (`ggml_rope_multi`,
    /// mode `GGML_ROPE_TYPE_MROPE`): `a` `[d, heads, n, B]` (f32, contiguous rows), each row's
    /// value `i < d / 2` rotated with value `i + d / 2` by the angle `p * freq_base^(-2i/d) /
    /// freq_factors[i]`, where `p` is the token's position in the section of pair `i`
    /// (`sections`: pairs per section, at most four, summing to `d / 2`; `pos` I32 `[4 n]`:
    /// the tokens' positions of section 0, then 1, 2 and 3). `freq_factors` F32 `[d / 2]`.
    pub fn rope_sections(
        &self,
        a: &GTensor,
        pos: &GTensor,
        freq_factors: &GTensor,
        sections: [usize; 4],
        freq_base: f32,
    ) -> Result<GTensor> {
        let [d, _, n, _] = a.ne();
        let half = d / 2;
        let rows_ok = a.nb()[0] == 4;
        if a.dtype() != Some(DType::F32)
            || !rows_ok
            || d == 0
            || d % 2 != 0
            || sections.iter().sum::<usize>() != half
        {
            return Err(bad(
                "rope_sections",
                format!(
                    "{:?} {:?} with sections {sections:?} (f32 rows of an even width, the \
                     sections summing to half of it)",
                    a.dtype(),
                    a.ne()
                ),
            ));
        }
        if pos.dtype() != Some(DType::I32) || pos.ne() != [4 * n, 1, 1, 1] {
            return Err(bad(
                "rope_sections",
                format!("positions {:?} {:?} for {n} tokens", pos.dtype(), pos.ne()),
            ));
        }
        if freq_factors.dtype() != Some(DType::F32) || freq_factors.ne() != [half, 1, 1, 1] {
            return Err(bad(
                "rope_sections",
                format!(
                    "frequency factors {:?} {:?} for width {d}",
                    freq_factors.dtype(),
                    freq_factors.ne()
                ),
            ));
        }
        let mut s = sections.map(|x| x as i32);
        // SAFETY: checked; ggml copies the sections into the op's parameters.
        self.op("rope_sections", 1, |c| unsafe {
            sys::ggml_rope_multi(
                c,
                a.raw(),
                pos.raw(),
                freq_factors.raw(),
                d as i32,
                s.as_mut_ptr(),
                sys::GGML_ROPE_TYPE_MROPE as i32,
                0,
                freq_base,
                1.0,
                0.0,
                1.0,
                0.0,
                0.0,
            )
        })
    }

    /// Mean over `ne[0]` (result `[1, ...]`).
    pub fn mean(&self, a: &GTensor) -> Result<GTensor> {
        // SAFETY: float tensor.
        self.op("mean", 1, |c| unsafe { sys::ggml_mean(c, a.raw()) })
    }

    /// Sum of all elements (result `[1]`).
    pub fn sum(&self, a: &GTensor) -> Result<GTensor> {
        // SAFETY: float tensor.
        self.op("sum", 1, |c| unsafe { sys::ggml_sum(c, a.raw()) })
    }

    /// `same_shape` helper exposed for model code assertions.
    pub fn same_shape(a: &GTensor, b: &GTensor) -> bool {
        same_shape(a, b)
    }
}
