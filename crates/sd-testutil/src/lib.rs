//! Helpers the tests and benchmarks of every sd-rs crate share, instead of copying them:
//!
//! - [`rnd`] / [`rnd_scaled`]: deterministic uniform data from a seed (an LCG: the same values
//!   on every machine, no `rand` dependency).
//! - [`rel_l2`], [`max_abs`], [`check_close`]: the error metrics the parity tests report.
//! - [`f16_round`], [`f32_bytes`], [`bits`]: value conversions for bit-exact comparisons.
//! - [`SafetensorsWriter`]: writes small aligned safetensors files for loader and engine tests.
//! - [`fixture!`]: the path of a file under the calling crate's `tests/fixtures`.
//!
//! This crate is a dev-dependency only (`publish = false`); it depends on `std` and `half`
//! alone so that the lowest crates can use it too.

use std::io::Write;
use std::path::Path;

/// `n` deterministic values uniform in `[-1, 1)` from `seed` (a 64-bit LCG, top 24 bits).
pub fn rnd(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// [`rnd`] multiplied by `scale` (weights of a stable toy network).
pub fn rnd_scaled(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    rnd(n, seed).into_iter().map(|x| x * scale).collect()
}

/// Each value rounded through f16 (what an f16 weight holds).
pub fn f16_round(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect()
}

/// Little-endian bytes of `v`.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Little-endian f32 values of `b` (whose length is a multiple of 4).
pub fn f32_from_bytes(b: &[u8]) -> Vec<f32> {
    assert_eq!(b.len() % 4, 0, "f32 bytes");
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The bit patterns of `v`, for exact comparisons that also tell `-0.0` and NaNs apart.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// `|got - want|_2 / |want|_2`, in f64.
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "element counts");
    let (mut num, mut den) = (0f64, 0f64);
    for (&a, &b) in got.iter().zip(want) {
        num += (a as f64 - b as f64).powi(2);
        den += (b as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// The largest `|a - b|`.
pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "element counts");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Asserts that `got` is finite and within relative L2 `tol` of `want`; prints the error
/// (visible with `--nocapture`) so a passing run still reports its parity number.
pub fn check_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let e = rel_l2(got, want);
    println!("{what}: relative L2 error {e:.3e}");
    assert!(e <= tol, "{what}: relative L2 error {e:.3e} > {tol:e}");
}

/// The path of `$name` under the calling crate's `tests/fixtures/`.
#[macro_export]
macro_rules! fixture {
    ($name:expr) => {
        ::std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join($name)
    };
}

/// One tensor for [`SafetensorsWriter`].
#[derive(Clone, Debug)]
pub struct StTensor {
    /// Its name.
    pub name: String,
    /// The safetensors dtype name (`F32`, `F16`, `BF16`, `I32` ...).
    pub dtype: &'static str,
    /// Its shape, outermost first (PyTorch order).
    pub shape: Vec<u64>,
    /// Its bytes, little-endian.
    pub bytes: Vec<u8>,
}

impl StTensor {
    /// An f32 tensor of `values` (shape outermost first).
    pub fn f32(name: &str, shape: &[u64], values: &[f32]) -> Self {
        assert_eq!(
            shape.iter().product::<u64>() as usize,
            values.len(),
            "{name}: shape and value count"
        );
        Self {
            name: name.to_string(),
            dtype: "F32",
            shape: shape.to_vec(),
            bytes: f32_bytes(values),
        }
    }

    /// An f16 tensor of `values` rounded to f16.
    pub fn f16(name: &str, shape: &[u64], values: &[f32]) -> Self {
        assert_eq!(
            shape.iter().product::<u64>() as usize,
            values.len(),
            "{name}: shape and value count"
        );
        Self {
            name: name.to_string(),
            dtype: "F16",
            shape: shape.to_vec(),
            bytes: values
                .iter()
                .flat_map(|&x| half::f16::from_f32(x).to_le_bytes())
                .collect(),
        }
    }
}

/// Writes safetensors files: a JSON header padded so that the data starts 64-byte aligned
/// (as mmap-based loaders expect), tensors in the order given, optional `__metadata__`.
#[derive(Clone, Debug, Default)]
pub struct SafetensorsWriter {
    tensors: Vec<StTensor>,
    metadata: Vec<(String, String)>,
}

impl SafetensorsWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a tensor.
    pub fn tensor(mut self, t: StTensor) -> Self {
        self.tensors.push(t);
        self
    }

    /// Adds tensors.
    pub fn tensors(mut self, ts: impl IntoIterator<Item = StTensor>) -> Self {
        self.tensors.extend(ts);
        self
    }

    /// Adds a `__metadata__` entry.
    pub fn metadata(mut self, key: &str, value: &str) -> Self {
        self.metadata.push((key.to_string(), value.to_string()));
        self
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut header = String::from("{");
        let mut first = true;
        if !self.metadata.is_empty() {
            header.push_str("\"__metadata__\":{");
            for (i, (k, v)) in self.metadata.iter().enumerate() {
                if i > 0 {
                    header.push(',');
                }
                header.push_str(&format!("{}:{}", json_string(k), json_string(v)));
            }
            header.push('}');
            first = false;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            if !first {
                header.push(',');
            }
            first = false;
            let shape: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
            let end = offset + t.bytes.len() as u64;
            header.push_str(&format!(
                "{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
                json_string(&t.name),
                t.dtype,
                shape.join(",")
            ));
            offset = end;
        }
        header.push('}');
        // 8 bytes of length + header, padded with spaces to a multiple of 64.
        while (8 + header.len()) % 64 != 0 {
            header.push(' ');
        }
        let mut out = Vec::with_capacity(8 + header.len() + offset as usize);
        out.extend_from_slice(&(header.len() as u64).to_le_bytes());
        out.extend_from_slice(header.as_bytes());
        for t in &self.tensors {
            out.extend_from_slice(&t.bytes);
        }
        out
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut f = std::fs::File::create(path)?;
        f.write_all(&self.to_bytes())?;
        f.sync_all()
    }
}

/// `s` as a JSON string literal.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rnd_is_deterministic_and_in_range() {
        let a = rnd(1000, 7);
        assert_eq!(a, rnd(1000, 7));
        assert_ne!(a, rnd(1000, 8));
        assert!(a.iter().all(|&x| (-1.0..1.0).contains(&x)));
    }

    #[test]
    fn metrics() {
        assert_eq!(rel_l2(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_l2(&[0.0, 0.0], &[3.0, 4.0]) - 1.0).abs() < 1e-12);
        assert_eq!(max_abs(&[1.0, -2.0], &[1.5, 0.0]), 2.0);
    }

    #[test]
    fn safetensors_layout_is_aligned_and_parsable() {
        let bytes = SafetensorsWriter::new()
            .metadata("k", "v\"q")
            .tensor(StTensor::f32("a.weight", &[2, 2], &[1.0, 2.0, 3.0, 4.0]))
            .tensor(StTensor::f16("b", &[3], &[0.5, 1.0, 2.0]))
            .to_bytes();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!((8 + n) % 64, 0);
        let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        assert!(header
            .contains("\"a.weight\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}"));
        assert!(header.contains("\"b\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[16,22]}"));
        assert!(header.contains("\"k\":\"v\\\"q\""));
        assert_eq!(bytes.len(), 8 + n + 22);
        assert_eq!(
            f32_from_bytes(&bytes[8 + n..8 + n + 16]),
            vec![1.0, 2.0, 3.0, 4.0]
        );
    }
}
