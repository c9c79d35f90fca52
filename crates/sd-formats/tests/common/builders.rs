//! Byte builders for hand-made model files (safetensors headers, GGUF headers, pickles and
//! legacy PyTorch files), shared by the hostile-input and fuzz tests through `#[path]`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use sd_formats::files::{parse, FileError, ParsedFile, ReadOptions};
use sd_formats::FileId;

/// The fixture directory.
pub fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/files")
}

/// A fixture's bytes.
pub fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixture_dir().join(name)).unwrap()
}

/// Parses bytes as a model file named `hostile.bin`.
pub fn parse_bytes(b: &[u8]) -> Result<ParsedFile, FileError> {
    let b = b.to_vec();
    parse(
        &b,
        Path::new("hostile.bin"),
        FileId(0),
        ReadOptions::default(),
    )
}

/// A safetensors file from a JSON header and data.
pub fn safetensors(header: &str, data: &[u8]) -> Vec<u8> {
    let mut v = (header.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

/// A GGUF writer at the byte level.
#[derive(Default)]
pub struct Gguf(pub Vec<u8>);

impl Gguf {
    /// Magic, version and counts.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut g = Gguf(b"GGUF".to_vec());
        g.u32(version).u64(n_tensors).u64(n_kv);
        g
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// A tensor info with `ne` innermost first.
    pub fn tensor(&mut self, name: &str, ne: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.str(name).u32(ne.len() as u32);
        for &d in ne {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }
    /// Pads to 32 and appends data.
    pub fn data(&mut self, bytes: &[u8]) -> Vec<u8> {
        while self.0.len() & 31 != 0 {
            self.0.push(0);
        }
        self.0.extend_from_slice(bytes);
        self.0.clone()
    }
}

/// A pickle writer (protocol 2 opcodes).
pub struct Pickle(pub Vec<u8>);

impl Default for Pickle {
    fn default() -> Self {
        Self::new()
    }
}

impl Pickle {
    pub fn new() -> Self {
        Pickle(vec![0x80, 2])
    }
    pub fn op(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    pub fn s(mut self, x: &str) -> Self {
        self.0.push(b'X');
        self.0.extend_from_slice(&(x.len() as u32).to_le_bytes());
        self.0.extend_from_slice(x.as_bytes());
        self
    }
    pub fn int(mut self, i: i32) -> Self {
        self.0.push(b'J');
        self.0.extend_from_slice(&i.to_le_bytes());
        self
    }
    pub fn global(mut self, module: &str, name: &str) -> Self {
        self.0.push(b'c');
        self.0
            .extend_from_slice(format!("{module}\n{name}\n").as_bytes());
        self
    }
    pub fn stack_global(self, module: &str, name: &str) -> Self {
        self.op(&[0x80, 4]).s(module).s(name).op(&[0x93])
    }
    pub fn ints(mut self, v: &[u64]) -> Self {
        self = self.op(b"(");
        for &x in v {
            self = self.int(x as i32);
        }
        self.op(b"t")
    }
    /// `_rebuild_tensor_v2(('storage', torch.<class>, key, 'cpu', numel), offset, shape, stride, False, {})`
    pub fn tensor(
        self,
        class: &str,
        key: &str,
        numel: u64,
        offset: u64,
        shape: &[u64],
        stride: &[u64],
    ) -> Self {
        self.global("torch._utils", "_rebuild_tensor_v2")
            .op(b"((")
            .s("storage")
            .global("torch", class)
            .s(key)
            .s("cpu")
            .int(numel as i32)
            .op(b"tQ")
            .int(offset as i32)
            .ints(shape)
            .ints(stride)
            .op(b"\x89}tR")
    }
    pub fn stop(self) -> Vec<u8> {
        self.op(b".").0
    }
}

/// A legacy PyTorch file: magic, protocol, system info, `main`, the keys, then the storages
/// (element count and bytes).
pub fn legacy(main: &[u8], keys: &[&str], storages: &[(u64, &[u8])]) -> Vec<u8> {
    let mut v = vec![0x80, 2, 0x8a, 10];
    v.extend_from_slice(&0x1950a86a20f9469cfc6cu128.to_le_bytes()[..10]);
    v.push(b'.');
    v.extend_from_slice(b"\x80\x02M\xe9\x03.");
    v.extend_from_slice(
        &Pickle::new()
            .op(b"}")
            .s("little_endian")
            .op(b"\x88s")
            .stop(),
    );
    v.extend_from_slice(main);
    let mut k = Pickle::new().op(b"](");
    for key in keys {
        k = k.s(key);
    }
    v.extend_from_slice(&k.op(b"e").stop());
    for (count, bytes) in storages {
        v.extend_from_slice(&count.to_le_bytes());
        v.extend_from_slice(bytes);
    }
    v
}

/// f32 bytes of 0, 1, 2, ...
pub fn f32_ramp(n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
}
