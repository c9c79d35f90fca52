//! Parameter declaration ([`ParamBuilder`]) and a simple CPU loader ([`load_all_to_cpu`]).
//!
//! Shapes: a declared shape is PyTorch's, outermost first; the ggml tensor gets the reversed
//! dims (`ne`, innermost first). A `Linear` weight `[out, in]` becomes `ne = [in, out]` and is
//! applied as `mul_mat(w, x)`; a `Conv2d` weight `[oc, ic, kh, kw]` becomes
//! `ne = [kw, kh, ic, oc]`. ggml has four dims: a 5-D shape (a 3-D convolution kernel
//! `[oc, ic, kt, kh, kw]`) folds its two outermost dims, `ne = [kw, kh, kt, ic * oc]` (the
//! same bytes; stable-diffusion.cpp's `CausalConv3d` layout).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

use sd_formats::files::TensorCatalog;
use sd_formats::names::{convert_to_canonical_report, SdVersion};
use sd_formats::TensorStorage;
use sd_tensor::ggml::{Buffer, BufferType, Context, GTensor};
use sd_tensor::DType;

use crate::{ModelError, Result};

/// Default number of descriptors of a parameter context (an SD UNet has about 700
/// parameters, SDXL's about 1700; a descriptor costs a few hundred bytes).
pub const DEFAULT_PARAM_CAPACITY: usize = 4096;

struct Inner<'a> {
    ctx: Context,
    catalog: Option<&'a TensorCatalog>,
    weight_type: Option<DType>,
    /// Under a quantized `weight_type`, the type of the weights it does not quantize
    /// (`None`: the file's); see [`ParamBuilder::set_unquantized_type`].
    unquantized_type: Option<DType>,
    /// Storage type of synthetic (catalog-less) parameters.
    synthetic: DType,
    params: BTreeMap<String, GTensor>,
}

/// Declares a model's parameter tensors by canonical name in a no-alloc parameter context.
///
/// With a catalog, each tensor takes its dtype from the file (1-D tensors and those declared
/// with [`ParamBuilder::tensor_f32`] are kept in f32, as ggml's broadcasting ops need, and
/// non-float storage types become f32) and its shape is checked against the file's. Without
/// one (synthetic configs) every tensor is f32. Builders are cheap handles: [`pp`] returns
/// one for a sub-path sharing the same registry.
///
/// [`pp`]: ParamBuilder::pp
#[derive(Clone)]
pub struct ParamBuilder<'a> {
    inner: Rc<RefCell<Inner<'a>>>,
    prefix: String,
}

impl std::fmt::Debug for ParamBuilder<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamBuilder")
            .field("prefix", &self.prefix)
            .field("declared", &self.inner.borrow().params.len())
            .finish()
    }
}

/// Whether two shapes describe the same bytes: equal after dropping trailing 1-sized
/// dimensions (a `[C, C]` linear weight stored as a `[C, C, 1, 1]` 1x1 convolution).
fn shapes_compatible(file: &[u64], expected: &[usize]) -> bool {
    let trim_f = file.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
    let trim_e = expected.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
    trim_f == trim_e
        && file[..trim_f]
            .iter()
            .zip(&expected[..trim_e])
            .all(|(&a, &b)| a == b as u64)
}

/// The dtype a parameter gets from its storage.
fn param_dtype(storage: &TensorStorage, expected: &[usize], force_f32: bool) -> DType {
    let d = storage.dtype;
    let inner = expected.last().copied().unwrap_or(1);
    if force_f32
        || expected.len() <= 1
        || !(d.is_float() || d.is_quantized())
        || d == DType::F64
        || !inner.is_multiple_of(d.block_size())
    {
        DType::F32
    } else {
        d
    }
}

/// The dtype of a parameter under a `--type` override `t` (see
/// [`ParamBuilder::set_weight_type`]); `unquantized` is the type of the weights a quantized
/// `t` does not take (see [`ParamBuilder::set_unquantized_type`]).
fn override_dtype(
    from_file: DType,
    t: DType,
    unquantized: Option<DType>,
    expected: &[usize],
    force_f32: bool,
) -> DType {
    let inner = expected.last().copied().unwrap_or(1);
    if force_f32 || expected.len() <= 1 {
        return from_file;
    }
    if t.is_quantized() {
        if expected.len() == 2 && inner.is_multiple_of(t.block_size()) {
            t
        } else {
            unquantized.unwrap_or(from_file)
        }
    } else if t.is_float() && t != DType::F64 {
        t
    } else {
        from_file
    }
}

/// The type of the weights a quantized `--type` leaves unquantized (see
/// [`ParamBuilder::set_unquantized_type`]) for a model computed with `weight_type` where
/// this crate's CPU kernels run (`host_kernels`): bf16 where the CPU has AMX-BF16 tiles, so
/// that the convolutions run on the tiles beside the quantized linear layers (a q8_0 UNet
/// keeps half its work in 3x3 kernels, which q8_0 cannot hold: blocks run along rows of 3
/// values); same bytes as the f16 of a checkpoint. `None` elsewhere: the file's type.
pub fn unquantized_type_for(weight_type: Option<DType>, host_kernels: bool) -> Option<DType> {
    (host_kernels
        && weight_type.is_some_and(|t| t.is_quantized())
        && sd_tensor::ggml::cpu_amx_bf16())
    .then_some(DType::BF16)
}

/// Whether the CPU attention kernel runs its products in bf16 for a model computed with
/// `weight_type` where this crate's CPU kernels run (`host_kernels`): with bf16 weights, and
/// with quantized weights where the CPU has AMX-BF16 tiles (whose other products are bf16
/// then, see [`unquantized_type_for`]).
pub fn bf16_attention_for(weight_type: Option<DType>, host_kernels: bool) -> bool {
    host_kernels
        && (weight_type == Some(DType::BF16)
            || unquantized_type_for(weight_type, host_kernels).is_some())
}

impl<'a> ParamBuilder<'a> {
    /// A builder over `catalog` (`None`: synthetic f32 parameters) with room for
    /// `capacity` parameter descriptors.
    pub fn new(catalog: Option<&'a TensorCatalog>, capacity: usize) -> Result<Self> {
        Self::with_synthetic_dtype(catalog, capacity, DType::F32)
    }

    /// Like [`ParamBuilder::new`], but parameters declared without a catalog are stored as
    /// `dtype` where a file could store them so (tensors of 2 or more dimensions whose rows
    /// fit `dtype`'s blocks, not declared with [`ParamBuilder::tensor_f32`]); the rest stay
    /// f32. For synthetic full-size models (benchmarks).
    pub fn with_synthetic_dtype(
        catalog: Option<&'a TensorCatalog>,
        capacity: usize,
        dtype: DType,
    ) -> Result<Self> {
        Ok(ParamBuilder {
            inner: Rc::new(RefCell::new(Inner {
                ctx: Context::new_descriptors(capacity, 1, 0)?,
                catalog,
                weight_type: None,
                unquantized_type: None,
                synthetic: dtype,
                params: BTreeMap::new(),
            })),
            prefix: String::new(),
        })
    }

    /// Converts weights to `dtype` when they are loaded (`--type`; `None`: the file's types).
    ///
    /// Applies to every parameter that would get a float or quantized type from the file
    /// (1-D tensors and those declared with [`ParamBuilder::tensor_f32`] stay f32); a
    /// quantized type applies to 2-D matrices whose rows are whole blocks only (linear
    /// weights; convolution kernels keep the file's type).
    pub fn set_weight_type(&self, dtype: Option<DType>) {
        self.inner.borrow_mut().weight_type = dtype;
    }

    /// Under a quantized [`set_weight_type`](Self::set_weight_type) (or a quantized
    /// synthetic type), the type of the weights it does not quantize (convolution kernels,
    /// whose rows are not whole blocks); `None` (the default): the file's type (f32 for
    /// synthetic parameters). See [`unquantized_type_for`] for the runtime's choice.
    pub fn set_unquantized_type(&self, dtype: Option<DType>) {
        self.inner.borrow_mut().unquantized_type = dtype;
    }

    /// A builder whose names are prefixed with `self`'s path and `name` (dot-separated).
    pub fn pp(&self, name: impl AsRef<str>) -> ParamBuilder<'a> {
        let name = name.as_ref();
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else if name.is_empty() {
            self.prefix.clone()
        } else {
            format!("{}.{}", self.prefix, name)
        };
        ParamBuilder {
            inner: self.inner.clone(),
            prefix,
        }
    }

    /// The current path prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn full(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        }
    }

    /// Whether parameters come from a catalog (false: synthetic parameters declared from a
    /// configuration alone, as benchmarks and `sd-bench write-weights` use them).
    pub fn has_catalog(&self) -> bool {
        self.inner.borrow().catalog.is_some()
    }

    /// Whether the catalog holds `name` (always true without a catalog).
    pub fn contains(&self, name: &str) -> bool {
        let full = self.full(name);
        self.inner
            .borrow()
            .catalog
            .is_none_or(|c| c.get(&full).is_some())
    }

    /// The shape (PyTorch order) of `name` in the catalog; `None` without a catalog or when
    /// the catalog has no such tensor. For models whose dimensions are read from the
    /// tensors.
    pub fn file_shape(&self, name: &str) -> Option<Vec<u64>> {
        let full = self.full(name);
        let inner = self.inner.borrow();
        inner.catalog?.get(&full).map(|s| s.shape.clone())
    }

    /// Declares parameter `name` (under this builder's prefix) of PyTorch shape `shape`
    /// (1 to 5 dims; see the module documentation for 5).
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<GTensor> {
        self.declare(name, shape, false)
    }

    /// Like [`ParamBuilder::tensor`], but always f32 (embeddings added to activations).
    pub fn tensor_f32(&self, name: &str, shape: &[usize]) -> Result<GTensor> {
        self.declare(name, shape, true)
    }

    fn declare(&self, name: &str, shape: &[usize], force_f32: bool) -> Result<GTensor> {
        let full = self.full(name);
        let mut inner = self.inner.borrow_mut();
        if inner.params.contains_key(&full) {
            return Err(ModelError::Duplicate { name: full });
        }
        if shape.is_empty() || shape.len() > 5 || shape.contains(&0) {
            return Err(ModelError::Config(format!(
                "tensor `{full}` declared with shape {shape:?}"
            )));
        }
        let dtype = match inner.catalog {
            None => {
                let d = inner.synthetic;
                let inner_dim = shape.last().copied().unwrap_or(1);
                if force_f32 || shape.len() <= 1 || !(d.is_float() || d.is_quantized()) {
                    DType::F32
                } else if !inner_dim.is_multiple_of(d.block_size()) {
                    // What a quantized type does not take: the unquantized type where one
                    // is set (as `--type` over a file), else f32.
                    match inner.unquantized_type {
                        Some(u) if d.is_quantized() => u,
                        _ => DType::F32,
                    }
                } else {
                    d
                }
            }
            Some(cat) => {
                let st = cat
                    .get(&full)
                    .ok_or_else(|| ModelError::MissingTensor { name: full.clone() })?;
                if !shapes_compatible(&st.shape, shape) {
                    return Err(ModelError::ShapeMismatch {
                        name: full,
                        file: st.shape.clone(),
                        expected: shape.to_vec(),
                    });
                }
                let from_file = param_dtype(st, shape, force_f32);
                match inner.weight_type {
                    Some(t) if from_file != DType::F32 || st.dtype.is_float() => {
                        override_dtype(from_file, t, inner.unquantized_type, shape, force_f32)
                    }
                    _ => from_file,
                }
            }
        };
        let mut ne: Vec<usize> = shape.iter().rev().copied().collect();
        if ne.len() == 5 {
            let outer = ne.pop().unwrap_or(1);
            ne[3] = ne[3].checked_mul(outer).ok_or_else(|| {
                ModelError::Config(format!("tensor `{full}` declared with shape {shape:?}"))
            })?;
        }
        let t = inner.ctx.new_tensor(dtype, &ne)?;
        t.set_name(&full);
        t.set_param();
        inner.params.insert(full, t.clone());
        Ok(t)
    }

    /// Ends declaration: the registry of declared parameters.
    pub fn finish(&self) -> Params {
        let inner = self.inner.borrow();
        Params {
            ctx: inner.ctx.clone(),
            tensors: inner.params.clone(),
        }
    }
}

/// The declared parameters of a model: their no-alloc context and `name -> tensor`.
#[derive(Clone, Debug)]
pub struct Params {
    /// The parameter context (descriptors only until some buffer holds them).
    pub ctx: Context,
    /// Every declared parameter by canonical name.
    pub tensors: BTreeMap<String, GTensor>,
}

impl Params {
    /// Total bytes of the parameters' data.
    pub fn nbytes(&self) -> usize {
        self.tensors.values().map(|t| t.nbytes()).sum()
    }
}

/// Allocates one CPU buffer for every parameter of `params` and fills it from `catalog`
/// (converting each tensor to its declared dtype). The returned buffer must outlive every
/// use of the parameters.
pub fn load_all_to_cpu(params: &Params, catalog: &TensorCatalog) -> Result<Buffer> {
    let buffer = BufferType::cpu().alloc_context_tensors(&params.ctx)?;
    for (name, t) in &params.tensors {
        let dtype = t
            .dtype()
            .ok_or_else(|| ModelError::Config(format!("tensor `{name}` has an unknown type")))?;
        let bytes = catalog.read_converted(name, dtype)?;
        if bytes.len() != t.nbytes() {
            return Err(ModelError::Config(format!(
                "tensor `{name}`: {} bytes read, {} expected",
                bytes.len(),
                t.nbytes()
            )));
        }
        t.write_bytes(0, &bytes)?;
    }
    Ok(buffer)
}

/// Fills every parameter of `params` (already in a host buffer) with values from `f`,
/// called with the parameter's name and element count (synthetic weights for tests).
pub fn fill_with(params: &Params, mut f: impl FnMut(&str, usize) -> Vec<f32>) -> Result<Buffer> {
    let buffer = BufferType::cpu().alloc_context_tensors(&params.ctx)?;
    for (name, t) in &params.tensors {
        t.write_f32(&f(name, t.nelements()))?;
    }
    Ok(buffer)
}

/// Renames every tensor of `catalog` to its canonical name with
/// [`sd_formats::names::convert_to_canonical_report`] (diffusers and OpenCLIP layouts;
/// fused q/k/v split).
pub fn canonicalize(catalog: &mut TensorCatalog, version: Option<SdVersion>) -> Result<()> {
    let inputs: Vec<TensorStorage> = catalog.tensors().cloned().collect();
    let report = convert_to_canonical_report(inputs.clone(), version)?;
    let split: std::collections::HashSet<&str> = report.split.iter().map(String::as_str).collect();
    // Outputs are in input order, a split input's parts in its place.
    let mut map: std::collections::HashMap<String, Vec<TensorStorage>> =
        std::collections::HashMap::with_capacity(inputs.len());
    let mut it = report.tensors.into_iter();
    for input in &inputs {
        let n = if split.contains(input.name.as_str()) {
            3
        } else {
            1
        };
        map.insert(input.name.clone(), it.by_ref().take(n).collect());
    }
    catalog.rename(|t| map.get(&t.name).cloned().unwrap_or_else(|| vec![t.clone()]))?;
    Ok(())
}
