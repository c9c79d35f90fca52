//! [`TensorCatalog`]: the catalog of every opened model file's tensors.
//!
//! Files are added with an optional name prefix; their tensors go into one map keyed by name.
//! **Duplicates**: when a later file holds a name already in the catalog, the later file's
//! tensor replaces the earlier one and a `tracing` warning is logged (stable-diffusion.cpp
//! behaves the same way); two equal names within one file are an error.
//!
//! Reading checks every range again, so a file that shrank after it was opened gives an error,
//! not garbage or a panic.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::hash::Hasher;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::UNIX_EPOCH;

use memmap2::Mmap;
use sd_tensor::{convert, DType};

use super::error::{Ctx, FileError};
use super::layout::{byte_size, check_bounds};
use super::source::{read_exact_at, FileSource, Source};
use super::{parse, sharded, FileFormat, FileMetadata, ReadOptions};
use crate::{FileId, TensorStorage};

/// Options of a [`TensorCatalog`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CatalogOptions {
    /// How files are read.
    pub read: ReadOptions,
}

/// The consumer of [`TensorCatalog::load_tensors`]: called with each tensor's name and bytes,
/// possibly from several threads at once.
pub type TensorSink<'a, E> = dyn Fn(&str, &[u8]) -> Result<(), E> + Sync + 'a;

/// One opened file.
#[derive(Debug)]
pub struct FileRecord {
    /// Its id in the catalog.
    pub id: FileId,
    /// The path it was opened with.
    pub path: PathBuf,
    /// Its format.
    pub format: FileFormat,
    /// Its length in bytes when opened.
    pub size: u64,
    /// A hash of its length and modification time when opened (changes when the file does).
    pub revision: u64,
    /// The prefix given when it was added (empty for none).
    pub prefix: String,
    /// Format-specific header data.
    pub metadata: FileMetadata,
    /// Number of tensors it held when added.
    pub tensor_count: usize,
    file: File,
    map: Mutex<Option<Arc<Mmap>>>,
}

/// A tensor's bytes inside a mapped file: no copy.
#[derive(Clone, Debug)]
pub struct MappedTensor {
    map: Arc<Mmap>,
    range: Range<usize>,
}

impl MappedTensor {
    /// The tensor's bytes.
    pub fn bytes(&self) -> &[u8] {
        // In range: checked against the map's length when created.
        &self.map[self.range.clone()]
    }

    /// The byte range in the file.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The whole mapped file.
    pub fn mmap(&self) -> &Arc<Mmap> {
        &self.map
    }
}

impl std::ops::Deref for MappedTensor {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.bytes()
    }
}

/// An error from [`TensorCatalog::load_tensors`]: reading failed, or the sink refused a tensor.
#[derive(Debug)]
pub enum LoadError<E> {
    /// Reading or converting a tensor failed.
    File(FileError),
    /// The sink returned an error for a tensor.
    Sink {
        /// The tensor.
        tensor: String,
        /// The sink's error.
        error: E,
    },
}

impl<E: fmt::Display> fmt::Display for LoadError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LoadError::File(e) => e.fmt(f),
            LoadError::Sink { tensor, error } => write!(f, "storing tensor `{tensor}`: {error}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for LoadError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LoadError::File(e) => Some(e),
            LoadError::Sink { error, .. } => Some(error),
        }
    }
}

impl<E> From<FileError> for LoadError<E> {
    fn from(e: FileError) -> Self {
        LoadError::File(e)
    }
}

/// The catalog of model files and their tensors.
#[derive(Debug, Default)]
pub struct TensorCatalog {
    opts: CatalogOptions,
    files: Vec<FileRecord>,
    tensors: BTreeMap<String, TensorStorage>,
}

/// FNV-1a over the file's length and modification time.
fn revision(meta: &std::fs::Metadata) -> u64 {
    struct Fnv(u64);
    impl Hasher for Fnv {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
            }
        }
    }
    let mut h = Fnv(0xcbf2_9ce4_8422_2325);
    h.write(&meta.len().to_le_bytes());
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    h.write(&mtime.to_le_bytes());
    h.finish()
}

impl TensorCatalog {
    /// An empty catalog with default options (strict pickle globals).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty catalog with options.
    pub fn with_options(opts: CatalogOptions) -> Self {
        TensorCatalog {
            opts,
            ..Self::default()
        }
    }

    /// Opens a model file and adds its tensors. With a prefix, every name that does not already
    /// start with it gets it prepended (pass the separator too: `"first_stage_model."`).
    pub fn add_file(
        &mut self,
        path: impl AsRef<Path>,
        prefix: Option<&str>,
    ) -> Result<FileId, FileError> {
        let path = path.as_ref();
        let ctx = Ctx::new(path);
        let _span = tracing::info_span!("add_model_file", path = %path.display()).entered();
        let id =
            FileId(u32::try_from(self.files.len()).map_err(|_| ctx.unsupported("too many files"))?);
        let file = File::open(path).map_err(|e| ctx.io(e))?;
        let meta = file.metadata().map_err(|e| ctx.io(e))?;
        let src =
            FileSource::new(file.try_clone().map_err(|e| ctx.io(e))?).map_err(|e| ctx.io(e))?;
        let parsed = parse(&src, path, id, self.opts.read)?;
        let prefix = prefix.unwrap_or("");
        let mut tensors = parsed.tensors;
        if !prefix.is_empty() {
            for t in &mut tensors {
                if !t.name.starts_with(prefix) {
                    t.name.insert_str(0, prefix);
                }
            }
            super::layout::check_unique(&ctx, tensors.iter().map(|t| t.name.as_str()))?;
        }
        let tensor_count = tensors.len();
        for t in tensors {
            if let Some(old) = self.tensors.get(&t.name) {
                let old_path = self
                    .files
                    .get(old.file.0 as usize)
                    .map(|r| r.path.display().to_string());
                tracing::warn!(tensor = %t.name, earlier = ?old_path, later = %path.display(), "tensor in two files; the later one wins");
            }
            self.tensors.insert(t.name.clone(), t);
        }
        tracing::info!(format = %parsed.format, tensors = tensor_count, "opened model file");
        self.files.push(FileRecord {
            id,
            path: path.to_path_buf(),
            format: parsed.format,
            size: src.len(),
            revision: revision(&meta),
            prefix: prefix.to_string(),
            metadata: parsed.metadata,
            tensor_count,
            file,
            map: Mutex::new(None),
        });
        Ok(id)
    }

    /// Adds every component of a diffusers pipeline folder (see
    /// [`super::diffusers_folder`]), each under its folder's prefix (`unet.`, `vae.`,
    /// `text_encoder.`, ...).
    pub fn add_diffusers_folder(
        &mut self,
        dir: impl AsRef<Path>,
    ) -> Result<Vec<FileId>, FileError> {
        let dir = dir.as_ref();
        let _span = tracing::info_span!("add_diffusers_folder", path = %dir.display()).entered();
        let mut ids = Vec::new();
        for c in super::diffusers_folder::components(dir)? {
            if super::sharded::is_index_path(&c.path) {
                ids.extend(self.add_sharded(&c.path, Some(c.prefix))?);
            } else {
                ids.push(self.add_file(&c.path, Some(c.prefix))?);
            }
        }
        Ok(ids)
    }

    /// Adds every shard of a sharded safetensors model (`*.safetensors.index.json`), checking
    /// that each tensor the index lists is in the shard it names.
    pub fn add_sharded(
        &mut self,
        index: impl AsRef<Path>,
        prefix: Option<&str>,
    ) -> Result<Vec<FileId>, FileError> {
        let index = index.as_ref();
        let ctx = Ctx::new(index);
        let idx = sharded::read_index(index)?;
        let mut ids = HashMap::new();
        for shard in idx.shards() {
            let id = self.add_file(sharded::shard_path(index, shard), prefix)?;
            ids.insert(shard.to_string(), id);
        }
        let prefix = prefix.unwrap_or("");
        for (name, shard) in &idx.weight_map {
            let full = if name.starts_with(prefix) {
                name.clone()
            } else {
                format!("{prefix}{name}")
            };
            let ok = self
                .tensors
                .get(&full)
                .is_some_and(|t| ids.get(shard) == Some(&t.file));
            if !ok {
                return Err(ctx.bad_tensor(
                    name,
                    format!("the index puts it in `{shard}`, which does not hold it"),
                ));
            }
        }
        let mut v: Vec<FileId> = ids.into_values().collect();
        v.sort();
        Ok(v)
    }

    /// All opened files, indexed by [`FileId`].
    pub fn files(&self) -> &[FileRecord] {
        &self.files
    }

    /// One opened file.
    pub fn file(&self, id: FileId) -> Option<&FileRecord> {
        self.files.get(id.0 as usize)
    }

    fn record(&self, id: FileId) -> Result<&FileRecord, FileError> {
        self.file(id).ok_or(FileError::NoSuchFile(id))
    }

    /// Every tensor, in name order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorStorage> + '_ {
        self.tensors.values()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the catalog holds no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The tensor with this name.
    pub fn get(&self, name: &str) -> Option<&TensorStorage> {
        self.tensors.get(name)
    }

    fn lookup(&self, name: &str) -> Result<&TensorStorage, FileError> {
        self.get(name).ok_or_else(|| FileError::NotFound {
            name: name.to_string(),
        })
    }

    /// Names starting with `prefix`, in order.
    pub fn names_with_prefix<'a>(&'a self, prefix: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.tensors
            .range::<str, _>((
                std::ops::Bound::Included(prefix),
                std::ops::Bound::Unbounded,
            ))
            .map(|(k, _)| k.as_str())
            .take_while(move |k| k.starts_with(prefix))
    }

    /// Checks that a storage lies in its file and that its size matches dtype and shape.
    fn validate(&self, t: &TensorStorage) -> Result<(), FileError> {
        let rec = self.record(t.file)?;
        let ctx = Ctx::new(&rec.path);
        let expected = byte_size(&ctx, &t.name, t.dtype, &t.shape)?;
        if expected != t.size {
            return Err(FileError::SizeMismatch {
                path: rec.path.clone(),
                tensor: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                expected,
                actual: t.size,
            });
        }
        check_bounds(&ctx, &t.name, t.offset, t.size, rec.size)?;
        Ok(())
    }

    /// Replaces every entry by what `f` returns for it: one entry to rename, several to split
    /// (see [`TensorStorage::split_outer`]), none to drop. Each result must lie in its file
    /// with a size matching its dtype and shape; two results with one name are an error. On
    /// error the catalog is unchanged.
    pub fn rename(
        &mut self,
        f: impl Fn(&TensorStorage) -> Vec<TensorStorage>,
    ) -> Result<(), FileError> {
        let mut out = BTreeMap::new();
        let mut origin: HashMap<String, String> = HashMap::new();
        for t in self.tensors.values() {
            for n in f(t) {
                self.validate(&n)?;
                if let Some(first) = origin.insert(n.name.clone(), t.name.clone()) {
                    let path = self.record(t.file)?.path.clone();
                    return Err(FileError::RenameCollision {
                        path,
                        name: n.name,
                        first,
                        second: t.name.clone(),
                    });
                }
                out.insert(n.name.clone(), n);
            }
        }
        self.tensors = out;
        Ok(())
    }

    /// Removes the prefix from every name that starts with it (collisions are an error).
    pub fn strip_prefix(&mut self, prefix: &str) -> Result<(), FileError> {
        self.rename(|t| {
            let mut t = t.clone();
            if let Some(rest) = t.name.strip_prefix(prefix) {
                t.name = rest.to_string();
            }
            vec![t]
        })
    }

    /// Removes every tensor whose name starts with `prefix`; returns how many.
    pub fn remove_with_prefix(&mut self, prefix: &str) -> usize {
        let before = self.tensors.len();
        self.tensors.retain(|k, _| !k.starts_with(prefix));
        before - self.tensors.len()
    }

    /// Keeps the tensors for which `keep` returns true.
    pub fn retain(&mut self, mut keep: impl FnMut(&TensorStorage) -> bool) {
        self.tensors.retain(|_, t| keep(t));
    }

    /// Copies a storage's bytes out of its file.
    pub fn read_storage(&self, t: &TensorStorage) -> Result<Vec<u8>, FileError> {
        let rec = self.record(t.file)?;
        let ctx = Ctx::new(&rec.path);
        check_bounds(&ctx, &t.name, t.offset, t.size, rec.size)?;
        let mut buf = vec![0u8; t.size as usize];
        read_exact_at(&rec.file, t.offset, &mut buf).map_err(|e| ctx.io(e))?;
        Ok(buf)
    }

    /// Copies a tensor's bytes, as stored.
    pub fn read_raw(&self, name: &str) -> Result<Vec<u8>, FileError> {
        self.read_storage(self.lookup(name)?)
    }

    /// Reads a storage and converts it to `dst` (rows are the innermost dimension).
    pub fn read_storage_converted(
        &self,
        t: &TensorStorage,
        dst: DType,
    ) -> Result<Vec<u8>, FileError> {
        let raw = self.read_storage(t)?;
        if t.dtype == dst {
            return Ok(raw);
        }
        let row = t.shape.last().copied().unwrap_or(1).max(1);
        let row = usize::try_from(row).unwrap_or(usize::MAX);
        convert::convert(t.dtype, &raw, dst, row).map_err(|source| FileError::Convert {
            path: self
                .file(t.file)
                .map(|r| r.path.clone())
                .unwrap_or_default(),
            tensor: t.name.clone(),
            source,
        })
    }

    /// Reads a tensor converted to `dst`.
    pub fn read_converted(&self, name: &str, dst: DType) -> Result<Vec<u8>, FileError> {
        self.read_storage_converted(self.lookup(name)?, dst)
    }

    /// Reads `(name, dtype)` tensors on `threads` threads (0: one per core), converting each and
    /// handing it to `sink`. Requests are served in file order. Stops at and returns the first
    /// error; unknown names are reported before anything is read.
    pub fn load_tensors<E: Send>(
        &self,
        requests: &[(String, DType)],
        threads: usize,
        sink: &TensorSink<'_, E>,
    ) -> Result<(), LoadError<E>> {
        let mut jobs = Vec::with_capacity(requests.len());
        for (name, dtype) in requests {
            jobs.push((self.lookup(name)?, *dtype));
        }
        jobs.sort_by_key(|(t, _)| (t.file, t.offset));
        let total: u64 = jobs.iter().map(|(t, _)| t.size).sum();
        let _span =
            tracing::info_span!("load_tensors", tensors = jobs.len(), bytes = total).entered();
        let threads = match threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        }
        .min(jobs.len())
        .max(1);

        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let first_error: Mutex<Option<LoadError<E>>> = Mutex::new(None);
        let work = || {
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((t, dtype)) = jobs.get(i) else { break };
                let result = self
                    .read_storage_converted(t, *dtype)
                    .map_err(LoadError::File)
                    .and_then(|bytes| {
                        sink(&t.name, &bytes).map_err(|error| LoadError::Sink {
                            tensor: t.name.clone(),
                            error,
                        })
                    });
                if let Err(e) = result {
                    stop.store(true, Ordering::Relaxed);
                    let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    if slot.is_none() {
                        *slot = Some(e);
                    }
                    break;
                }
            }
        };
        if threads == 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(work);
                }
            });
        }
        match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Maps a file into memory (once; later calls share the map).
    pub fn map_file(&self, id: FileId) -> Result<Arc<Mmap>, FileError> {
        let rec = self.record(id)?;
        let ctx = Ctx::new(&rec.path);
        let mut slot = rec.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = slot.as_ref() {
            return Ok(m.clone());
        }
        let now = rec.file.metadata().map_err(|e| ctx.io(e))?.len();
        if now < rec.size {
            return Err(FileError::Changed {
                path: rec.path.clone(),
                detail: format!("length {} is now {now}", rec.size),
            });
        }
        // SAFETY: the map is read-only. Model files are not modified while sd-rs has them
        // open (documented requirement); the length was checked just above.
        let map = unsafe { Mmap::map(&rec.file) }.map_err(|e| ctx.io(e))?;
        if (map.len() as u64) < rec.size {
            return Err(FileError::Changed {
                path: rec.path.clone(),
                detail: "mapped fewer bytes than expected".into(),
            });
        }
        let map = Arc::new(map);
        *slot = Some(map.clone());
        Ok(map)
    }

    /// A tensor's bytes in the mapped file, without copying.
    pub fn try_mapped_bytes(&self, name: &str) -> Result<MappedTensor, FileError> {
        let t = self.lookup(name)?;
        let map = self.map_file(t.file)?;
        let rec = self.record(t.file)?;
        let end = check_bounds(
            &Ctx::new(&rec.path),
            &t.name,
            t.offset,
            t.size,
            map.len() as u64,
        )?;
        Ok(MappedTensor {
            map,
            range: t.offset as usize..end as usize,
        })
    }

    /// [`Self::try_mapped_bytes`], with `None` for unknown names and files that cannot be
    /// mapped (logged).
    pub fn mapped_bytes(&self, name: &str) -> Option<MappedTensor> {
        match self.try_mapped_bytes(name) {
            Ok(m) => Some(m),
            Err(FileError::NotFound { .. }) => None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot map tensor");
                None
            }
        }
    }

    /// Names of the tensors of one file.
    pub fn names_in_file(&self, id: FileId) -> impl Iterator<Item = &str> + '_ {
        self.tensors
            .values()
            .filter(move |t| t.file == id)
            .map(|t| t.name.as_str())
    }

    /// The files that still hold at least one tensor of the catalog.
    pub fn distinct_files(&self) -> HashSet<FileId> {
        self.tensors.values().map(|t| t.file).collect()
    }
}
