//! Loading params copies from the model files.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use sd_tensor::ggml::{BufferType, BufferUsage, Context, DeviceKind, GTensor, SharedBytes};
use sd_tensor::{DType, GgmlError};

use super::blocks::{plan_chunks, StorageBlock};
use super::state::{ParamState, ResidencyMode, StorageLoc};
use super::ModelManager;
use crate::residency::{BackendId, BlockId, ParamId, ResidencyError, Result, SourceId};
use sd_formats::files::{LoadError, TensorCatalog};

/// Checks that `name` is in the catalog with `shape` (outermost first).
pub(crate) fn validate_against_file(
    loader: &TensorCatalog,
    source: SourceId,
    name: &str,
    shape: &[u64],
) -> Result<()> {
    let t = loader
        .get(name)
        .ok_or_else(|| ResidencyError::MissingTensor {
            name: name.to_string(),
            source_id: source,
        })?;
    // Trailing (outermost) dimensions of 1 are not significant in ggml.
    let trim = |s: &[u64]| -> Vec<u64> {
        let first = s.iter().position(|&d| d != 1).unwrap_or(s.len());
        s[first..].to_vec()
    };
    // ggml has four dims: a 5-D tensor (a 3-D convolution kernel `[oc, ic, kt, kh, kw]`) is
    // declared with its two outermost dims folded into one.
    let file_shape: Vec<u64> = match t.shape.as_slice() {
        [oc, ic, rest @ ..] if t.shape.len() == 5 => std::iter::once(oc.saturating_mul(*ic))
            .chain(rest.iter().copied())
            .collect(),
        s => s.to_vec(),
    };
    // Trailing (innermost) dimensions of 1 describe the same bytes too (a `[C]` scale
    // stored as `[C, 1, 1, 1]`, a linear weight stored as a 1x1 convolution).
    let trim_inner = |s: &[u64]| -> Vec<u64> {
        let last = s.iter().rposition(|&d| d != 1).map_or(0, |i| i + 1);
        s[..last].to_vec()
    };
    if trim(&file_shape) != trim(shape) && trim_inner(&file_shape) != trim_inner(shape) {
        return Err(ResidencyError::ShapeMismatch {
            name: name.to_string(),
            expected: shape.to_vec(),
            found: t.shape.clone(),
            path: loader
                .file(t.file)
                .map(|r| r.path.clone())
                .unwrap_or_default(),
        });
    }
    Ok(())
}

/// A params copy planned by one load call.
struct Planned {
    param: ParamId,
    desc: GTensor,
}

impl ModelManager {
    /// The buffer type of a parameter's params copy: the compute device's pinned host type
    /// when params live on the CPU and compute elsewhere (unless
    /// [`set_pinned_host_params`](ModelManager::set_pinned_host_params) turned it off), else
    /// the params backend's default.
    pub(crate) fn params_buffer_type(&self, s: &ParamState) -> BufferType {
        let (Some(pb), Some(pdev), Some(cdev)) = (
            self.backend(s.params_backend),
            self.device_of(s.params_backend),
            self.device_of(s.compute_backend),
        ) else {
            return BufferType::cpu();
        };
        if self.pinned_host_params && pdev != cdev && pdev.kind() == DeviceKind::Cpu {
            if let Some(h) = cdev.host_buffer_type() {
                return h;
            }
        }
        pb.buffer_type()
    }

    /// Whether the compute backend uses the params copy's memory directly.
    pub(crate) fn is_direct(&self, s: &ParamState) -> bool {
        let (Some(pdev), Some(cdev)) = (
            self.device_of(s.params_backend),
            self.device_of(s.compute_backend),
        ) else {
            return false;
        };
        pdev == cdev || (cdev.kind() == DeviceKind::Cpu && self.params_buffer_type(s).is_host())
    }

    fn mmap_allowed(&self, s: &ParamState) -> bool {
        self.mmap
            && s.mode == ResidencyMode::ParamBackend
            && !s.split
            && self.params_buffer_type(s).is_host()
            && !self.lora.targets(s)
            && self.sources[&s.source]
                .get(&s.name)
                .is_some_and(|t| t.dtype == s.dtype)
    }

    /// Loads, in one batch over the load threads, the params copies of those of `params`
    /// that keep one in their params backend ([`ResidencyMode::ParamBackend`]) and have
    /// not loaded it yet, instead of at their first use: a segmented run would otherwise
    /// read them from the files one segment's group at a time during its first step.
    /// Parameters read from the files at each use ([`ResidencyMode::Disk`]) are left as
    /// they are. Returns how many were loaded; on error nothing this call loaded stays.
    pub fn load_params_copies(&mut self, params: &[ParamId]) -> Result<usize> {
        let want: Vec<ParamId> = params
            .iter()
            .copied()
            .filter(|p| {
                self.states.get(p).is_some_and(|s| {
                    s.mode == ResidencyMode::ParamBackend && s.storage.is_none() && !s.split
                })
            })
            .collect();
        if want.is_empty() {
            return Ok(0);
        }
        self.load_to_params(&want)?;
        Ok(want.len())
    }

    /// Loads the params copies of `params` that are not loaded. Returns the blocks created;
    /// on error every block this call created is freed again and the states are unchanged.
    pub(crate) fn load_to_params(&mut self, params: &[ParamId]) -> Result<Vec<BlockId>> {
        let need: Vec<ParamId> = params
            .iter()
            .copied()
            .filter(|p| self.states.get(p).is_some_and(|s| s.storage.is_none()))
            .collect();
        if need.is_empty() {
            return Ok(Vec::new());
        }
        let _span = tracing::info_span!("load_params", params = need.len()).entered();
        for p in &need {
            let s = &self.states[p];
            validate_against_file(&self.sources[&s.source], s.source, &s.name, &s.shape)?;
        }
        let mut created = Vec::new();
        let mut extended: Vec<(BlockId, ParamId)> = Vec::new();
        let mut locs: Vec<(ParamId, StorageLoc)> = Vec::new();
        let result = self.load_inner(&need, &mut created, &mut extended, &mut locs);
        match result {
            Ok(()) => {
                for (p, loc) in locs {
                    if let Some(s) = self.states.get_mut(&p) {
                        s.storage = Some(loc);
                    }
                }
                Ok(created)
            }
            Err(e) => {
                for id in &created {
                    self.storage.remove(id);
                }
                for (id, p) in extended {
                    if let Some(b) = self.storage.get_mut(&id) {
                        b.members.retain(|m| *m != p);
                    }
                }
                tracing::warn!(error = %e, "loading weights failed; freed what this call allocated");
                Err(e)
            }
        }
    }

    fn load_inner(
        &mut self,
        need: &[ParamId],
        created: &mut Vec<BlockId>,
        extended: &mut Vec<(BlockId, ParamId)>,
        locs: &mut Vec<(ParamId, StorageLoc)>,
    ) -> Result<()> {
        let ctx = Context::new_descriptors(need.len(), 1, 0)
            .map_err(ResidencyError::ggml("creating storage descriptors"))?;
        let mut to_read: Vec<Planned> = Vec::new();
        // Groups for allocation: (params backend, buffer type name, mode, source).
        let mut groups: BTreeMap<(BackendId, String, ResidencyMode, SourceId), Vec<Planned>> =
            BTreeMap::new();
        let mut group_buft: HashMap<(BackendId, String, ResidencyMode, SourceId), BufferType> =
            HashMap::new();
        for p in need {
            let s = &self.states[p];
            let ne = s.tensor.ne();
            let desc = ctx
                .new_tensor(s.dtype, &ne[..s.tensor.n_dims().max(1)])
                .map_err(ResidencyError::ggml(format!("describing `{}`", s.name)))?;
            desc.set_name(&s.name);
            if self.mmap_allowed(s) {
                if let Some(loc) = self.try_map(*p, &desc, created, extended)? {
                    locs.push((*p, loc));
                    continue;
                }
            }
            let s = &self.states[p];
            let buft = self.params_buffer_type(s);
            let key = (s.params_backend, buft.name(), s.mode, s.source);
            group_buft.insert(key.clone(), buft);
            groups
                .entry(key)
                .or_default()
                .push(Planned { param: *p, desc });
        }
        for (key, items) in groups {
            let buft = group_buft[&key];
            let cap = if buft.is_host() {
                buft.max_size() as u64
            } else {
                self.max_block_bytes.min(buft.max_size() as u64)
            };
            let sizes: Vec<(usize, u64)> = items
                .iter()
                .enumerate()
                .map(|(i, it)| (i, buft.alloc_size(&it.desc) as u64))
                .collect();
            for (placements, size) in plan_chunks(&sizes, buft.alignment() as u64, cap) {
                let buffer = buft
                    .alloc(size as usize)
                    .map_err(ResidencyError::ggml("allocating params storage"))?;
                buffer.set_usage(BufferUsage::Weights);
                let id = self.new_block_id();
                let mut members = Vec::with_capacity(placements.len());
                for (i, off) in placements {
                    let it = &items[i];
                    buffer
                        .place(&it.desc, off as usize)
                        .map_err(ResidencyError::ggml("placing params storage"))?;
                    members.push(it.param);
                    locs.push((
                        it.param,
                        StorageLoc {
                            block: id,
                            desc: it.desc.clone(),
                            offset: off as usize,
                        },
                    ));
                }
                self.storage.insert(
                    id,
                    StorageBlock {
                        backend: key.0,
                        buffer,
                        members,
                        mapped: None,
                    },
                );
                created.push(id);
            }
            to_read.extend(items);
        }
        self.stream_from_files(&to_read)
    }

    /// Places `desc` in the zero-copy mapping of its file, if dtype, shape and alignment
    /// allow. Returns `None` to fall back to a normal load.
    fn try_map(
        &mut self,
        p: ParamId,
        desc: &GTensor,
        created: &mut Vec<BlockId>,
        extended: &mut Vec<(BlockId, ParamId)>,
    ) -> Result<Option<StorageLoc>> {
        let s = &self.states[&p];
        let (source, backend) = (s.source, s.params_backend);
        let loader = &self.sources[&source];
        let Some(storage) = loader.get(&s.name) else {
            return Ok(None);
        };
        if storage.size != desc.nbytes() as u64 {
            return Ok(None);
        }
        let file = storage.file;
        let offset = storage.offset as usize;
        let existing = self
            .storage
            .iter()
            .find(|(_, b)| b.mapped == Some((source, file)) && b.backend == backend)
            .map(|(id, _)| *id);
        let (id, is_new) = match existing {
            Some(id) => (id, false),
            None => {
                let map = match loader.map_file(file) {
                    Ok(m) => m,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot map model file; loading instead");
                        return Ok(None);
                    }
                };
                let bytes: SharedBytes = map;
                let buffer = match sd_tensor::ggml::Buffer::from_shared_bytes(bytes) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot wrap mapped model file; loading instead");
                        return Ok(None);
                    }
                };
                let id = self.new_block_id();
                self.storage.insert(
                    id,
                    StorageBlock {
                        backend,
                        buffer,
                        members: Vec::new(),
                        mapped: Some((source, file)),
                    },
                );
                created.push(id);
                (id, true)
            }
        };
        let block = self.storage.get_mut(&id).expect("block just found or made");
        if block.buffer.place(desc, offset).is_err() {
            // Unaligned in the file: load a copy instead.
            if is_new && block.members.is_empty() {
                self.storage.remove(&id);
                created.retain(|c| *c != id);
            }
            return Ok(None);
        }
        block.members.push(p);
        if !is_new {
            extended.push((id, p));
        }
        Ok(Some(StorageLoc {
            block: id,
            desc: desc.clone(),
            offset,
        }))
    }

    /// Reads the planned tensors from their sources, converting to the registered dtype.
    fn stream_from_files(&self, items: &[Planned]) -> Result<()> {
        let mut by_source: BTreeMap<SourceId, Vec<&Planned>> = BTreeMap::new();
        for it in items {
            by_source
                .entry(self.states[&it.param].source)
                .or_default()
                .push(it);
        }
        let device_lock = Mutex::new(());
        for (source, items) in by_source {
            let loader = &self.sources[&source];
            let mut requests: Vec<(String, DType)> = Vec::with_capacity(items.len());
            let mut dest: HashMap<&str, &GTensor> = HashMap::with_capacity(items.len());
            for it in &items {
                let s = &self.states[&it.param];
                requests.push((s.name.clone(), s.dtype));
                dest.insert(s.name.as_str(), &it.desc);
            }
            let sink = |name: &str, bytes: &[u8]| -> std::result::Result<(), GgmlError> {
                let t = dest
                    .get(name)
                    .ok_or_else(|| GgmlError::Mismatch(format!("`{name}` was not requested")))?;
                if bytes.len() != t.nbytes() {
                    return Err(GgmlError::DataMismatch {
                        name: name.to_string(),
                        detail: format!(
                            "the file gives {} bytes for {} bytes of tensor",
                            bytes.len(),
                            t.nbytes()
                        ),
                    });
                }
                if t.is_host() {
                    t.write_bytes(0, bytes)
                } else {
                    let _g = device_lock.lock().unwrap_or_else(|e| e.into_inner());
                    t.write_bytes(0, bytes)
                }
            };
            let _span =
                tracing::debug_span!("stream_source", source = source.0, tensors = requests.len())
                    .entered();
            loader
                .load_tensors(&requests, self.load_threads, &sink)
                .map_err(|e| match e {
                    LoadError::File(f) => ResidencyError::File(f),
                    LoadError::Sink { tensor, error } => ResidencyError::Ggml {
                        context: format!("storing `{tensor}`"),
                        source: error,
                    },
                })?;
        }
        Ok(())
    }

    /// Places the registered tensors of direct (params memory = compute memory) parameters
    /// over their params copies.
    pub(crate) fn bind_direct(&mut self, params: &[ParamId]) -> Result<()> {
        for p in params {
            let Some(s) = self.states.get(p) else {
                continue;
            };
            if s.bound || s.staged.is_some() || s.prefetched.is_some() || !self.is_direct(s) {
                continue;
            }
            let Some(loc) = s.storage.clone() else {
                continue;
            };
            let block = self
                .storage
                .get(&loc.block)
                .ok_or(ResidencyError::UnknownParam(*p))?;
            block
                .buffer
                .place(&s.tensor, loc.offset)
                .map_err(ResidencyError::ggml(format!("binding `{}`", s.name)))?;
            if let Some(s) = self.states.get_mut(p) {
                s.bound = true;
            }
        }
        Ok(())
    }
}
