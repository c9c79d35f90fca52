//! ggml backend modules loaded at run time (`libggml-cuda.so`, `libggml-vulkan.so`, ...), as
//! llama.cpp's dynamic-backend builds load them: every `libggml-*.so` of a directory (by
//! default the executable's) is opened with `ggml_backend_load` and its devices join ggml's
//! registry.
//!
//! A module that cannot be loaded (a missing library it needs, a ggml symbol the executable
//! does not export, an incompatible backend API version) is an [`GgmlError::ModuleLoad`]
//! carrying ggml's own explanation (its log lines captured during the load), never a crash;
//! the device list is then unchanged.

use std::collections::HashMap;
use std::ffi::{CStr, CString, OsStr};
use std::os::raw::{c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ggml_sys as sys;

use super::backend::Device;
use super::error::{GgmlError, Result};

/// The environment variable naming where backend modules are: `:`-separated files or
/// directories (directories are scanned for `libggml-*.so`). Unset: the executable's
/// directory. Set but empty: no modules.
pub const MODULES_ENV: &str = "SD_BACKEND_MODULES";

/// Modules loaded so far (canonical path -> device names they added), so that naming one
/// twice does not register its devices twice.
static LOADED: Mutex<Option<HashMap<PathBuf, Vec<String>>>> = Mutex::new(None);
/// ggml's log lines while a module loads (the log callback is process-global).
static CAPTURE: Mutex<String> = Mutex::new(String::new());

unsafe extern "C" fn capture_log(_level: sys::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: ggml passes a NUL-terminated message.
    let s = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    if let Ok(mut c) = CAPTURE.lock() {
        c.push_str(&s);
    }
}

/// What happened to one module found at start.
#[derive(Debug)]
pub struct ModuleOutcome {
    /// The module file (or the directory / file named that was not found).
    pub path: PathBuf,
    /// The names of the devices it added, or why it was not loaded.
    pub result: Result<Vec<String>>,
}

impl Device {
    /// Loads a ggml backend module (for example `libggml-cuda.so`, built from the same ggml
    /// source with `GGML_BACKEND_DL=ON`, `BUILD_SHARED_LIBS=ON`; `cargo xtask build-cuda`
    /// builds one) and registers its devices; returns the names of the devices it added.
    /// Loading the same file again returns the devices of the first load.
    ///
    /// The module's references to ggml's base library must resolve to this process's own
    /// (statically linked) copy, so the executable has to export its symbols (link with
    /// `-Wl,--export-dynamic`, as `sd` and `sd-bench` are), and the module's `NEEDED`
    /// `libggml-base.so.0` must be found by the dynamic loader (the module builds give it an
    /// empty stub of that name next to the module, found through the module's `$ORIGIN`
    /// run path, so a missing symbol is a load error rather than a silent second copy of
    /// ggml). ggml opens modules with `RTLD_NOW`. On failure the error carries ggml's log
    /// of the attempt (the loader's message, an API version mismatch, ...).
    pub fn load_module(path: &Path) -> Result<Vec<String>> {
        let err = |detail: String| GgmlError::ModuleLoad {
            path: path.display().to_string(),
            detail,
        };
        if !path.is_file() {
            return Err(err("no such file".into()));
        }
        let canon = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let mut loaded = LOADED.lock().unwrap_or_else(|e| e.into_inner());
        let loaded = loaded.get_or_insert_with(HashMap::new);
        if let Some(devs) = loaded.get(&canon) {
            return Ok(devs.clone());
        }
        let c = CString::new(path.as_os_str().to_string_lossy().as_bytes())
            .map_err(|_| err("the path contains a NUL byte".into()))?;
        let before: Vec<String> = Self::all().iter().map(Device::name).collect();
        let mut capture = CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
        capture.clear();
        drop(capture);
        // SAFETY: a valid callback for the duration of the load; NULL restores ggml's
        // default (stderr) logger afterwards. `LOADED` is held, so loads do not interleave.
        let reg = unsafe {
            sys::ggml_log_set(Some(capture_log), std::ptr::null_mut());
            let reg = sys::ggml_backend_load(c.as_ptr());
            sys::ggml_log_set(None, std::ptr::null_mut());
            reg
        };
        let log = std::mem::take(&mut *CAPTURE.lock().unwrap_or_else(|e| e.into_inner()));
        if reg.is_null() {
            let why: Vec<&str> = log
                .lines()
                .map(|l| l.trim())
                .filter(|l| !l.is_empty())
                .collect();
            return Err(err(if why.is_empty() {
                "ggml_backend_load failed (missing library, undefined symbol, or an \
                 incompatible backend API version)"
                    .into()
            } else {
                why.join("; ")
            }));
        }
        if !log.trim().is_empty() {
            tracing::debug!(module = %path.display(), "{}", log.trim());
        }
        let added: Vec<String> = Self::all()
            .iter()
            .map(Device::name)
            .filter(|n| !before.contains(n))
            .collect();
        loaded.insert(canon, added.clone());
        Ok(added)
    }

    /// Loads every backend module named in the environment variable `SD_BACKEND_MODULES`
    /// (files or directories, separated by `:`); returns the device names they added, or the
    /// first failure. Unset: nothing (see [`load_backend_modules`] for the start-up search
    /// that also looks next to the executable and reports each module).
    pub fn load_modules_from_env() -> Result<Vec<String>> {
        let Some(list) = std::env::var_os(MODULES_ENV) else {
            return Ok(Vec::new());
        };
        let mut added = Vec::new();
        for o in load_from_list(&list) {
            added.extend(o.result?);
        }
        Ok(added)
    }

    /// The features the device's backend reports (`ggml_backend_get_features`): for the CPU
    /// the instruction sets its kernels were built with (`AVX2`, `AVX512`, `AMX_INT8`,
    /// `NEON`, ...), for CUDA its architectures and options. Empty if it reports none.
    pub fn features(&self) -> Vec<(String, String)> {
        // SAFETY: live device; the registry's proc address, if present, has the documented
        // signature and returns an array ended by a NULL name.
        unsafe {
            let reg = sys::ggml_backend_dev_backend_reg(self.raw());
            if reg.is_null() {
                return Vec::new();
            }
            let name = c"ggml_backend_get_features";
            let p = sys::ggml_backend_reg_get_proc_address(reg, name.as_ptr());
            if p.is_null() {
                return Vec::new();
            }
            let f: unsafe extern "C" fn(sys::ggml_backend_reg_t) -> *mut sys::ggml_backend_feature =
                std::mem::transmute(p);
            let mut out = Vec::new();
            let mut it = f(reg);
            while !it.is_null() && !(*it).name.is_null() {
                let v = if (*it).value.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr((*it).value).to_string_lossy().into_owned()
                };
                out.push((CStr::from_ptr((*it).name).to_string_lossy().into_owned(), v));
                it = it.add(1);
            }
            out
        }
    }
}

/// Whether a file name is a backend module to load from a scanned directory: `libggml-*.so`
/// (or `.dylib`, `ggml-*.dll`), except ggml's base library and CPU variants (the CPU backend
/// is linked into the executable).
pub fn is_module_name(name: &str) -> bool {
    let stem = name
        .strip_prefix("lib")
        .unwrap_or(name)
        .strip_prefix("ggml-");
    let Some(stem) = stem else { return false };
    let ext_ok = [".so", ".dylib", ".dll"].iter().any(|e| stem.ends_with(e));
    ext_ok && !stem.starts_with("base") && !stem.starts_with("cpu")
}

/// The module files of a directory, sorted by name.
pub fn module_files(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)?
        .flatten()
        .filter(|e| e.file_type().map(|t| !t.is_dir()).unwrap_or(false))
        .filter(|e| is_module_name(&e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    v.sort();
    Ok(v)
}

fn load_from_list(list: &OsStr) -> Vec<ModuleOutcome> {
    let mut out = Vec::new();
    for p in std::env::split_paths(list).filter(|p| !p.as_os_str().is_empty()) {
        if p.is_dir() {
            out.extend(load_dir(&p));
        } else {
            out.push(ModuleOutcome {
                result: Device::load_module(&p),
                path: p,
            });
        }
    }
    out
}

fn load_dir(dir: &Path) -> Vec<ModuleOutcome> {
    match module_files(dir) {
        Ok(files) => files
            .into_iter()
            .map(|f| ModuleOutcome {
                result: Device::load_module(&f),
                path: f,
            })
            .collect(),
        Err(e) => vec![ModuleOutcome {
            path: dir.to_path_buf(),
            result: Err(GgmlError::ModuleLoad {
                path: dir.display().to_string(),
                detail: format!("cannot read the directory: {e}"),
            }),
        }],
    }
}

/// The start-up search: the modules named by `SD_BACKEND_MODULES` (files or directories,
/// `:`-separated; set but empty: none) or, when it is unset, every module in the
/// executable's directory. Returns one outcome per module tried, failures included, so the
/// caller can report them; the devices of the loaded ones are in [`Device::all`].
pub fn load_backend_modules() -> Vec<ModuleOutcome> {
    if let Some(list) = std::env::var_os(MODULES_ENV) {
        return load_from_list(&list);
    }
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|e| e.canonicalize().ok())
        .and_then(|e| e.parent().map(Path::to_path_buf));
    match exe_dir {
        Some(d) => load_dir(&d),
        None => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::is_module_name;

    #[test]
    fn module_names() {
        for yes in [
            "libggml-cuda.so",
            "libggml-vulkan.so",
            "ggml-cuda.dll",
            "libggml-x.dylib",
        ] {
            assert!(is_module_name(yes), "{yes}");
        }
        for no in [
            "libggml-base.so",
            "libggml-base.so.0",
            "libggml-cpu-haswell.so",
            "libggml.so",
            "libllama.so",
            "libggml-cuda.so.xz",
            "sd",
        ] {
            assert!(!is_module_name(no), "{no}");
        }
    }
}
