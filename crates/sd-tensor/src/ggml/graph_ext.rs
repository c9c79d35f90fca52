//! Small extensions used by the graph-cut planner (`sd-graphcut`):
//!
//! - exact source slots and view offsets of a tensor ([`GTensor::source_slots`],
//!   [`GTensor::view_source`], [`GTensor::view_offs`], [`GTensor::type_code`]);
//! - copies of tensor descriptors in another context with replaced sources
//!   ([`Context::new_tensor_like`], [`Context::copy_node`]), so that a segment of a graph can
//!   be rebuilt as its own graph without touching the original descriptors;
//! - measuring a graph's compute buffer while some of its leaves count as already allocated
//!   ([`measure_with_external`]), without giving them memory.

use ggml_sys as sys;

use super::backend::BufferType;
use super::context::Context;
use super::error::{GgmlError, Result};
use super::graph::Graph;
use super::tensor::GTensor;

const MAX_SRC: usize = sys::GGML_MAX_SRC as usize;

fn raw_ref(t: &GTensor) -> &sys::ggml_tensor {
    // SAFETY: the descriptor lives as long as its context, which `t` keeps alive.
    unsafe { &*t.raw() }
}

/// The source slots of `t` up to the last used one (empty slots in between are null).
fn used_srcs(t: &sys::ggml_tensor) -> &[*mut sys::ggml_tensor] {
    let used = t
        .src
        .iter()
        .rposition(|p| !p.is_null())
        .map_or(0, |i| i + 1);
    &t.src[..used]
}

fn same_layout(a: &sys::ggml_tensor, b: &sys::ggml_tensor) -> bool {
    a.type_ == b.type_ && a.ne == b.ne && a.nb == b.nb
}

impl GTensor {
    /// Byte offset of this view inside its view source (0 when the tensor is not a view).
    pub fn view_offs(&self) -> usize {
        raw_ref(self).view_offs
    }

    /// The raw ggml type code (also for types sd-rs has no [`DType`](crate::DType) for).
    pub fn type_code(&self) -> u32 {
        raw_ref(self).type_
    }

    /// The descriptor's address: equal for two handles of the same tensor while it lives
    /// (a key for lookups that need no handle, see [`source_addrs`](Self::source_addrs)).
    pub fn addr(&self) -> usize {
        self.raw() as usize
    }

    /// The descriptor addresses of this tensor's sources, one per slot up to the last
    /// used one (0 for an empty slot), without resolving them to handles: for callers that
    /// look sources up by [`addr`](Self::addr) and resolve only the ones they do not know
    /// (with [`source_slots`](Self::source_slots)).
    pub fn source_addrs(&self) -> Vec<usize> {
        used_srcs(raw_ref(self))
            .iter()
            .map(|&p| p as usize)
            .collect()
    }

    /// The descriptor address of this tensor's view source (0 when it is not a view).
    pub fn view_source_addr(&self) -> usize {
        raw_ref(self).view_src as usize
    }

    /// The source slots of this tensor's op, one entry per slot up to the last used one
    /// (`None` for an empty slot in between, e.g. an absent attention mask). A source that
    /// belongs to no live context is an error instead of being skipped.
    pub fn source_slots(&self) -> Result<Vec<Option<GTensor>>> {
        let srcs = used_srcs(raw_ref(self));
        let mut out = Vec::with_capacity(srcs.len());
        for (i, &p) in srcs.iter().enumerate() {
            if p.is_null() {
                out.push(None);
            } else {
                let s = Context::resolve(p).ok_or_else(|| {
                    GgmlError::Mismatch(format!(
                        "source {i} of '{}' belongs to no live context",
                        self.name()
                    ))
                })?;
                out.push(Some(s));
            }
        }
        Ok(out)
    }

    /// Sets ggml's output flag on this tensor only. (`set_output` follows `ggml_set_output`,
    /// which also flags every view source up the chain; a segment graph must not flag the
    /// tensors of other graphs it reads.)
    pub fn set_output_only(&self) -> &Self {
        let _g = self.context().lock();
        // SAFETY: live descriptor, context locked; only the flags word changes.
        unsafe { (*self.raw()).flags |= sys::GGML_TENSOR_FLAG_OUTPUT as i32 };
        self
    }

    /// The view source, if any; a view source that belongs to no live context is an error.
    pub fn view_source(&self) -> Result<Option<GTensor>> {
        let p = raw_ref(self).view_src;
        if p.is_null() {
            return Ok(None);
        }
        Context::resolve(p).map(Some).ok_or_else(|| {
            GgmlError::Mismatch(format!(
                "view source of '{}' belongs to no live context",
                self.name()
            ))
        })
    }
}

impl Context {
    /// A new leaf tensor (no op, no sources, no data) in this no_alloc context with the same
    /// type, dimensions and byte strides as `like`, named like it. It spans `like.nbytes()`
    /// bytes, so the data of `like` (a strided view included) can be copied into it byte for
    /// byte and read back with the same layout.
    pub fn new_tensor_like(&self, like: &GTensor) -> Result<GTensor> {
        if !self.is_no_alloc() {
            return Err(GgmlError::Mismatch(
                "new_tensor_like needs a no_alloc context".into(),
            ));
        }
        let src = raw_ref(like);
        let _g = self.lock();
        self.ensure_room("new_tensor_like", 1, 0)?;
        // SAFETY: room checked; type and dims come from a valid tensor.
        let t = unsafe { sys::ggml_new_tensor(self.raw(), src.type_, 4, src.ne.as_ptr()) };
        if t.is_null() {
            return Err(GgmlError::InvalidOperands {
                op: "new_tensor_like",
                detail: "ggml returned no tensor".into(),
            });
        }
        // SAFETY: `t` is a fresh descriptor without memory (lock held); the strides come
        // from a valid tensor of the same type and dimensions, and every allocator sizes it
        // by `ggml_nbytes`, which accounts for them.
        unsafe {
            (*t).nb = src.nb;
            (*t).name = src.name;
        }
        Ok(GTensor::from_raw(self.clone(), t))
    }

    /// A copy of op node `node`'s descriptor in this (no_alloc) context: same op, op
    /// parameters, type, dimensions, strides, flags and name, with sources `srcs` and, for a
    /// view, view source `view` = (tensor, byte offset). No data is copied or allocated.
    ///
    /// The copy computes exactly what `node` computes provided each replacement holds the
    /// data of what it replaces, so every replacement source must have the same type,
    /// dimensions and strides as the original source in that slot, empty slots must stay
    /// empty, and the view must fit inside its new view source. A slot in which the original
    /// reads itself (as `ggml_cast` does) must be `None` and makes the copy read itself.
    /// Anything else is an error.
    pub fn copy_node(
        &self,
        node: &GTensor,
        srcs: &[Option<GTensor>],
        view: Option<(&GTensor, usize)>,
    ) -> Result<GTensor> {
        if !self.is_no_alloc() {
            return Err(GgmlError::Mismatch(
                "copy_node needs a no_alloc context".into(),
            ));
        }
        let orig = raw_ref(node);
        let name = node.name();
        let bad = |detail: String| GgmlError::InvalidOperands {
            op: "copy_node",
            detail: format!("'{name}': {detail}"),
        };
        if orig.op == sys::GGML_OP_NONE {
            return Err(bad("is a leaf; use new_tensor_like".into()));
        }
        if srcs.len() > MAX_SRC {
            return Err(bad(format!("{} sources (at most {MAX_SRC})", srcs.len())));
        }
        for i in 0..MAX_SRC {
            let o = orig.src[i];
            if o == node.raw() {
                // The op reads its own result (ggml_cast's destination): the copy reads itself.
                if srcs.get(i).is_some_and(|s| s.is_some()) {
                    return Err(bad(format!(
                        "source slot {i} refers to the node itself; pass None"
                    )));
                }
                continue;
            }
            match (srcs.get(i).and_then(|s| s.as_ref()), o.is_null()) {
                (None, true) => {}
                (Some(_), true) => {
                    return Err(bad(format!("source slot {i} is empty in the original")))
                }
                (None, false) => return Err(bad(format!("source slot {i} is missing"))),
                (Some(s), false) => {
                    // SAFETY: the original's sources are live while the original is (the
                    // caller resolved them to build `srcs`).
                    let ot = unsafe { &*o };
                    if !same_layout(raw_ref(s), ot) {
                        return Err(bad(format!(
                            "source {i} '{}' has another type or layout than the original",
                            s.name()
                        )));
                    }
                }
            }
        }
        match (view, orig.view_src.is_null()) {
            (None, true) => {}
            (Some(_), true) => return Err(bad("is not a view".into())),
            (None, false) => return Err(bad("is a view; a view source is required".into())),
            (Some((v, offs)), false) => {
                let need = offs.checked_add(node.nbytes());
                if need.is_none_or(|e| e > v.nbytes()) {
                    return Err(bad(format!(
                        "{} bytes at offset {offs} do not fit in view source '{}' of {} bytes",
                        node.nbytes(),
                        v.name(),
                        v.nbytes()
                    )));
                }
            }
        }
        let _g = self.lock();
        self.ensure_room("copy_node", 1, 0)?;
        // SAFETY: room checked; type and dims come from a valid tensor.
        let t = unsafe { sys::ggml_new_tensor(self.raw(), orig.type_, 4, orig.ne.as_ptr()) };
        if t.is_null() {
            return Err(bad("ggml returned no tensor".into()));
        }
        // SAFETY: `t` is a fresh descriptor of this no_alloc context (lock held). Every
        // pointer written was checked above to be layout-compatible with what the original
        // points to; data, buffer and extra stay null until an allocator assigns memory.
        unsafe {
            let c = &mut *t;
            c.nb = orig.nb;
            c.op = orig.op;
            c.op_params = orig.op_params;
            c.flags = orig.flags;
            c.name = orig.name;
            for (i, s) in srcs.iter().enumerate() {
                c.src[i] = s.as_ref().map_or(std::ptr::null_mut(), |s| s.raw());
            }
            for i in 0..MAX_SRC {
                if orig.src[i] == node.raw() {
                    c.src[i] = t;
                }
            }
            if let Some((v, offs)) = view {
                c.view_src = v.raw();
                c.view_offs = offs;
            }
            c.data = std::ptr::null_mut();
            c.buffer = std::ptr::null_mut();
            c.extra = std::ptr::null_mut();
        }
        Ok(GTensor::from_raw(self.clone(), t))
    }
}

/// The compute buffer bytes a fresh graph allocator of buffer type `buft` needs for `graph`
/// when the tensors in `external` count as already allocated (their memory lives elsewhere,
/// e.g. weights or cached cut outputs). Nothing is allocated.
///
/// Each tensor in `external` must have no memory yet and must not be a view, and every view
/// source of a node must be part of the graph (ggml sizes its tables by the graph); during the
/// measurement it points at a zero-size placeholder buffer (its data stays null, so a
/// concurrent read is a [`GgmlError::NotAllocated`]), and it is reset afterwards.
pub fn measure_with_external(
    buft: BufferType,
    graph: &Graph,
    external: &[GTensor],
) -> Result<usize> {
    for t in external {
        if t.is_allocated() || t.has_buffer() {
            return Err(GgmlError::Mismatch(format!(
                "measure_with_external: '{}' already has memory",
                t.name()
            )));
        }
        if !raw_ref(t).view_src.is_null() {
            return Err(GgmlError::Mismatch(format!(
                "measure_with_external: '{}' is a view",
                t.name()
            )));
        }
    }
    // ggml's allocator hashes view sources too, in a table sized for the graph's nodes and
    // leaves: a view source outside the graph could overflow it (an abort).
    for node in graph.nodes() {
        if let Some(v) = node.view_source()? {
            if !graph.contains(&v) {
                return Err(GgmlError::Mismatch(format!(
                    "measure_with_external: view source '{}' of '{}' is not part of the graph",
                    v.name(),
                    node.name()
                )));
            }
        }
    }
    // SAFETY: a zero-size allocation returns ggml's dummy buffer (or NULL on failure).
    let placeholder = unsafe { sys::ggml_backend_buft_alloc_buffer(buft.raw(), 0) };
    if placeholder.is_null() {
        return Err(GgmlError::AllocationFailed {
            what: "placeholder buffer".into(),
            buffer_type: buft.name(),
            bytes: 0,
        });
    }
    // SAFETY: live buffer type; NULL on failure.
    let galloc = unsafe { sys::ggml_gallocr_new(buft.raw()) };
    if galloc.is_null() {
        // SAFETY: owned placeholder freed once.
        unsafe { sys::ggml_backend_buffer_free(placeholder) };
        return Err(GgmlError::AllocationFailed {
            what: "gallocr".into(),
            buffer_type: buft.name(),
            bytes: 0,
        });
    }
    let contexts = dedup_contexts(external);
    let mut size = 0usize;
    {
        let _guards: Vec<_> = contexts.iter().map(|c| c.lock()).collect();
        // SAFETY: the descriptors are live and their contexts locked; only the `buffer`
        // field is set (data stays null) and it is reset before the locks are released. The
        // measuring allocator treats tensors with a buffer as external and never touches
        // their data.
        unsafe {
            for t in external {
                (*t.raw()).buffer = placeholder;
            }
            sys::ggml_gallocr_reserve_n_size(
                galloc,
                graph.raw(),
                std::ptr::null(),
                std::ptr::null(),
                &mut size,
            );
            for t in external {
                (*t.raw()).buffer = std::ptr::null_mut();
            }
        }
    }
    // SAFETY: owned objects freed once; no tensor refers to the placeholder any more.
    unsafe {
        sys::ggml_gallocr_free(galloc);
        sys::ggml_backend_buffer_free(placeholder);
    }
    Ok(size)
}

fn dedup_contexts(tensors: &[GTensor]) -> Vec<Context> {
    let mut out: Vec<Context> = Vec::new();
    for t in tensors {
        if !out.iter().any(|o| o.serial() == t.context().serial()) {
            out.push(t.context().clone());
        }
    }
    out
}
