//! LyCORIS weight deltas: LoHa (Hadamard product of two low-rank matrices) and LoKr
//! (Kronecker product of two factors), as LyCORIS writes them and kohya-style loaders
//! (stable-diffusion.cpp, ComfyUI) read them.
//!
//! Tensors of a module `S` (shapes in file order, `W` the target weight `[out, in, k...]`):
//! - LoHa: `S.hada_w1_a [out, r]`, `S.hada_w1_b [r, in*k]` and the same for `w2`; the delta is
//!   `(w1_a @ w1_b) * (w2_a @ w2_b)` elementwise. In Tucker form (convolutions, with
//!   `S.hada_t1`/`S.hada_t2 [r, r, k...]`) `w1_a` is `[r, out]`, `w1_b` `[r, in]` and each
//!   factor is `sum_ij t[i, j, k] * a[i, p] * b[j, q]`. Scale: `alpha / r` (`r` = rows of
//!   `w1_b`), 1 without alpha.
//! - LoKr: `w1` = `S.lokr_w1 [a, b]` or `S.lokr_w1_a [a, r] @ S.lokr_w1_b [r, b]`; `w2` =
//!   `S.lokr_w2 [c, d, k...]`, `S.lokr_w2_a @ S.lokr_w2_b`, or Tucker with `S.lokr_t2`; the
//!   delta is `kron(w1, w2)` (`out = a*c`, `in = b*d`). Scale: `alpha / r` with `r` the rank of
//!   the decomposed factor (w2's when both are); 1 when both factors are whole (LyCORIS trains
//!   those at scale 1 and its loaders ignore alpha; PEFT's LoKr would use `alpha / r`).
//!
//! Everything is computed on the host in f32.

/// The LyCORIS tensor kinds, by their key suffix (without the leading dot).
pub(crate) const SUFFIXES: [&str; 13] = [
    "hada_w1_a",
    "hada_w1_b",
    "hada_w2_a",
    "hada_w2_b",
    "hada_t1",
    "hada_t2",
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
    "lokr_t2",
];

/// A named tensor of a LyCORIS file with its shape (file order).
#[derive(Clone, Debug)]
pub(crate) struct Named {
    pub name: String,
    pub shape: Vec<u64>,
}

/// One factor of a delta, seen as a matrix of `rows` x `cols` (trailing kernel dims folded
/// into the columns).
#[derive(Clone, Debug)]
pub(crate) enum Factor {
    /// Stored as it is.
    Whole(Named),
    /// `a [rows, r] @ b [r, cols...]`.
    Product { a: Named, b: Named },
    /// Tucker form: `t [ra, rb, k...]`, `a [ra, rows]`, `b [rb, cin]`; `cols = cin * k`.
    Tucker { t: Named, a: Named, b: Named },
}

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

impl Factor {
    /// `(rows, cols)` when the shapes are consistent.
    pub fn dims(&self) -> Result<(u64, u64), String> {
        match self {
            Factor::Whole(w) => match w.shape.first() {
                Some(&rows) if rows > 0 => Ok((rows, numel(&w.shape) / rows)),
                _ => Err(format!(
                    "`{}` of shape {:?} is not a matrix",
                    w.name, w.shape
                )),
            },
            Factor::Product { a, b } => {
                let ok = a.shape.len() == 2 && b.shape.len() >= 2 && a.shape[1] == b.shape[0];
                if !ok || a.shape[1] == 0 {
                    return Err(format!(
                        "`{}` {:?} and `{}` {:?} do not multiply",
                        a.name, a.shape, b.name, b.shape
                    ));
                }
                Ok((a.shape[0], numel(&b.shape[1..])))
            }
            Factor::Tucker { t, a, b } => {
                let ok = t.shape.len() >= 2
                    && a.shape.len() == 2
                    && b.shape.len() == 2
                    && a.shape[0] == t.shape[0]
                    && b.shape[0] == t.shape[1];
                if !ok {
                    return Err(format!(
                        "`{}` {:?}, `{}` {:?} and `{}` {:?} are not a Tucker decomposition",
                        t.name, t.shape, a.name, a.shape, b.name, b.shape
                    ));
                }
                Ok((a.shape[1], b.shape[1] * numel(&t.shape[2..])))
            }
        }
    }

    /// The rank of a decomposed factor (rows of its `b`), `None` for a whole one.
    pub fn rank(&self) -> Option<u64> {
        match self {
            Factor::Whole(_) => None,
            Factor::Product { b, .. } | Factor::Tucker { b, .. } => b.shape.first().copied(),
        }
    }

    /// The factor as a row-major `rows x cols` matrix; `read` gives a tensor's f32 values.
    pub fn dense<E>(
        &self,
        read: &mut impl FnMut(&str) -> Result<Vec<f32>, E>,
    ) -> Result<Vec<f32>, E> {
        match self {
            Factor::Whole(w) => read(&w.name),
            Factor::Product { a, b } => {
                let (av, bv) = (read(&a.name)?, read(&b.name)?);
                let (rows, rank) = (a.shape[0] as usize, a.shape[1] as usize);
                let cols = bv.len() / rank.max(1);
                let mut out = vec![0f32; rows * cols];
                for i in 0..rows {
                    let row = &mut out[i * cols..(i + 1) * cols];
                    for r in 0..rank {
                        let u = av[i * rank + r];
                        let brow = &bv[r * cols..(r + 1) * cols];
                        row.iter_mut().zip(brow).for_each(|(o, v)| *o += u * v);
                    }
                }
                Ok(out)
            }
            Factor::Tucker { t, a, b } => {
                let (tv, av, bv) = (read(&t.name)?, read(&a.name)?, read(&b.name)?);
                let (ra, rb) = (t.shape[0] as usize, t.shape[1] as usize);
                let kernel = numel(&t.shape[2..]) as usize;
                let (rows, cin) = (a.shape[1] as usize, b.shape[1] as usize);
                // tmp[i, q, k] = sum_j t[i, j, k] * b[j, q]
                let mut tmp = vec![0f32; ra * cin * kernel];
                for i in 0..ra {
                    for j in 0..rb {
                        let tk = &tv[(i * rb + j) * kernel..(i * rb + j + 1) * kernel];
                        for q in 0..cin {
                            let w = bv[j * cin + q];
                            let dst = &mut tmp[(i * cin + q) * kernel..(i * cin + q + 1) * kernel];
                            dst.iter_mut().zip(tk).for_each(|(d, v)| *d += w * v);
                        }
                    }
                }
                // out[p, q, k] = sum_i a[i, p] * tmp[i, q, k]
                let cols = cin * kernel;
                let mut out = vec![0f32; rows * cols];
                for p in 0..rows {
                    let row = &mut out[p * cols..(p + 1) * cols];
                    for i in 0..ra {
                        let w = av[i * rows + p];
                        let src = &tmp[i * cols..(i + 1) * cols];
                        row.iter_mut().zip(src).for_each(|(d, v)| *d += w * v);
                    }
                }
                Ok(out)
            }
        }
    }
}

/// How two factors make a delta.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Combine {
    /// LoHa: elementwise product of two factors of the weight's shape.
    Hadamard,
    /// LoKr: Kronecker product.
    Kronecker,
}

/// A LyCORIS delta of one weight.
#[derive(Clone, Debug)]
pub(crate) struct Delta {
    pub combine: Combine,
    pub w1: Factor,
    pub w2: Factor,
}

impl Delta {
    /// Builds the delta of a module from its tensors by suffix, or says what is missing.
    pub fn from_parts(
        parts: &std::collections::BTreeMap<&'static str, Named>,
    ) -> Result<Delta, String> {
        let get = |k: &str| parts.get(k).cloned();
        let need = |k: &str| get(k).ok_or_else(|| format!("has no `{k}`"));
        if parts.keys().any(|k| k.starts_with("hada_")) {
            let factor = |n: u8| -> Result<Factor, String> {
                let (a, b) = (
                    need(&format!("hada_w{n}_a"))?,
                    need(&format!("hada_w{n}_b"))?,
                );
                Ok(match get(&format!("hada_t{n}")) {
                    Some(t) => Factor::Tucker { t, a, b },
                    None => Factor::Product { a, b },
                })
            };
            return Ok(Delta {
                combine: Combine::Hadamard,
                w1: factor(1)?,
                w2: factor(2)?,
            });
        }
        let w1 = match get("lokr_w1") {
            Some(w) => Factor::Whole(w),
            None => Factor::Product {
                a: need("lokr_w1_a")?,
                b: need("lokr_w1_b")?,
            },
        };
        let w2 = match (get("lokr_w2"), get("lokr_t2")) {
            (Some(w), _) => Factor::Whole(w),
            (None, Some(t)) => Factor::Tucker {
                t,
                a: need("lokr_w2_a")?,
                b: need("lokr_w2_b")?,
            },
            (None, None) => Factor::Product {
                a: need("lokr_w2_a")?,
                b: need("lokr_w2_b")?,
            },
        };
        Ok(Delta {
            combine: Combine::Kronecker,
            w1,
            w2,
        })
    }

    /// Checks that the delta has `out` rows and `numel / out` columns.
    pub fn check(&self, out: u64, numel: u64) -> Result<(), String> {
        let (r1, c1) = self.w1.dims()?;
        let (r2, c2) = self.w2.dims()?;
        let (rows, cols) = match self.combine {
            Combine::Hadamard => {
                if (r1, c1) != (r2, c2) {
                    return Err(format!("factors of {r1}x{c1} and {r2}x{c2} differ"));
                }
                (r1, c1)
            }
            Combine::Kronecker => (r1 * r2, c1 * c2),
        };
        if out == 0 || rows != out || rows.checked_mul(cols) != Some(numel) {
            return Err(format!(
                "makes a {rows}x{cols} delta for a weight of {out} rows and {numel} values"
            ));
        }
        Ok(())
    }

    /// The scale before the multiplier: `alpha / rank` where the convention has a rank.
    pub fn scale(&self, alpha: Option<f32>) -> f32 {
        let rank = match self.combine {
            Combine::Hadamard => self.w1.rank(),
            Combine::Kronecker => self.w2.rank().or(self.w1.rank()),
        };
        match (alpha, rank) {
            (Some(a), Some(r)) if r > 0 => a / r as f32,
            _ => 1.0,
        }
    }

    /// Adds `scale` times the delta to `w` (row-major, the weight's shape).
    pub fn add_to<E>(
        &self,
        w: &mut [f32],
        scale: f32,
        read: &mut impl FnMut(&str) -> Result<Vec<f32>, E>,
    ) -> Result<(), E> {
        let w1 = self.w1.dense(read)?;
        let w2 = self.w2.dense(read)?;
        match self.combine {
            Combine::Hadamard => {
                for ((x, a), b) in w.iter_mut().zip(&w1).zip(&w2) {
                    *x += scale * a * b;
                }
            }
            Combine::Kronecker => {
                let (Ok((a, b)), Ok((c, d))) = (self.w1.dims(), self.w2.dims()) else {
                    return Ok(());
                };
                let (a, b, c, d) = (a as usize, b as usize, c as usize, d as usize);
                let cols = b * d;
                for i1 in 0..a {
                    for j1 in 0..b {
                        let u = scale * w1[i1 * b + j1];
                        if u == 0.0 {
                            continue;
                        }
                        for i2 in 0..c {
                            let dst = &mut w[(i1 * c + i2) * cols + j1 * d..][..d];
                            let src = &w2[i2 * d..(i2 + 1) * d];
                            dst.iter_mut().zip(src).for_each(|(x, v)| *x += u * v);
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, shape: &[u64]) -> Named {
        Named {
            name: name.into(),
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn kronecker_places_blocks() {
        // kron([[1, 2]], [[1], [10]]) = [[1, 2], [10, 20]]
        let d = Delta {
            combine: Combine::Kronecker,
            w1: Factor::Whole(named("w1", &[1, 2])),
            w2: Factor::Whole(named("w2", &[2, 1])),
        };
        d.check(2, 4).unwrap();
        assert!(d.check(4, 4).is_err());
        let mut w = vec![0f32; 4];
        let mut read = |n: &str| -> Result<Vec<f32>, ()> {
            Ok(if n == "w1" {
                vec![1., 2.]
            } else {
                vec![1., 10.]
            })
        };
        d.add_to(&mut w, 1.0, &mut read).unwrap();
        assert_eq!(w, [1., 2., 10., 20.]);
        assert_eq!(d.scale(Some(4.0)), 1.0);
    }

    #[test]
    fn tucker_equals_the_einsum() {
        // t [1, 1, 2], a [1, 2], b [1, 1]: out[p, 0, k] = t[k] * a[p] * b
        let f = Factor::Tucker {
            t: named("t", &[1, 1, 2]),
            a: named("a", &[1, 2]),
            b: named("b", &[1, 1]),
        };
        assert_eq!(f.dims().unwrap(), (2, 2));
        let mut read = |n: &str| -> Result<Vec<f32>, ()> {
            Ok(match n {
                "t" => vec![1., 2.],
                "a" => vec![3., 5.],
                _ => vec![7.],
            })
        };
        assert_eq!(f.dense(&mut read).unwrap(), [21., 42., 35., 70.]);
        assert_eq!(f.rank(), Some(1));
    }

    #[test]
    fn missing_parts_are_named() {
        let mut parts = std::collections::BTreeMap::new();
        parts.insert("hada_w1_a", named("x.hada_w1_a", &[4, 2]));
        let e = Delta::from_parts(&parts).unwrap_err();
        assert!(e.contains("hada_w1_b"), "{e}");
    }
}
