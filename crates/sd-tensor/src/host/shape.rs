//! Shape errors and shape arithmetic shared by the host tensor operations.

use thiserror::Error;

use crate::dtype::DType;

/// A shape that does not fit an operation. Every variant names the shapes involved.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ShapeError {
    /// The data length does not match the shape's element count.
    #[error("shape {shape:?} holds {expected} elements but {got} were given")]
    DataLength {
        /// The requested shape.
        shape: Vec<usize>,
        /// Elements the shape holds.
        expected: usize,
        /// Elements given.
        got: usize,
    },
    /// The byte length does not match the shape and element type.
    #[error("shape {shape:?} of {dtype} takes {expected} bytes but {got} were given")]
    ByteLength {
        /// The requested shape.
        shape: Vec<usize>,
        /// The element type.
        dtype: DType,
        /// Bytes the shape takes.
        expected: usize,
        /// Bytes given.
        got: usize,
    },
    /// The element count of a shape overflows `usize`.
    #[error("shape {shape:?} has more elements than fit in memory")]
    Overflow {
        /// The offending shape.
        shape: Vec<usize>,
    },
    /// Two shapes that must agree (or broadcast) do not.
    #[error("{op}: shapes {lhs:?} and {rhs:?} are incompatible")]
    Mismatch {
        /// The operation.
        op: &'static str,
        /// The first operand's shape.
        lhs: Vec<usize>,
        /// The second operand's shape.
        rhs: Vec<usize>,
    },
    /// A dimension index past the rank.
    #[error("{op}: dim {dim} is out of range for shape {shape:?}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension asked for.
        dim: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// An index range outside a dimension.
    #[error("{op}: range {start}..{end} is out of bounds for dim {dim} of shape {shape:?}")]
    OutOfRange {
        /// The operation.
        op: &'static str,
        /// The dimension.
        dim: usize,
        /// Range start.
        start: usize,
        /// Range end (exclusive).
        end: usize,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// A reshape to a different element count.
    #[error("cannot reshape {from:?} ({} elements) into {to:?}", from.iter().product::<usize>())]
    Reshape {
        /// The tensor's shape.
        from: Vec<usize>,
        /// The requested shape.
        to: Vec<usize>,
    },
    /// A permutation that is not one of the tensor's dims.
    #[error("{op}: {perm:?} is not a permutation of the dims of shape {shape:?}")]
    Permutation {
        /// The operation.
        op: &'static str,
        /// The permutation given.
        perm: Vec<usize>,
        /// The tensor's shape.
        shape: Vec<usize>,
    },
    /// An operation on a list of tensors that got none.
    #[error("{op}: no tensors given")]
    Empty {
        /// The operation.
        op: &'static str,
    },
    /// Any other shape requirement, described in words.
    #[error("{op}: shape {shape:?}: {detail}")]
    Invalid {
        /// The operation.
        op: &'static str,
        /// The tensor's shape.
        shape: Vec<usize>,
        /// What is wrong.
        detail: String,
    },
}

/// Element count of `shape` (1 for rank 0), or `None` on overflow.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Row-major strides (in elements) of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// The broadcast shape of `a` and `b` (numpy rules: dims aligned from the right must be equal
/// or 1).
pub fn broadcast_shapes(
    op: &'static str,
    a: &[usize],
    b: &[usize],
) -> Result<Vec<usize>, ShapeError> {
    let rank = a.len().max(b.len());
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = dim_from_right(a, rank - 1 - i);
        let db = dim_from_right(b, rank - 1 - i);
        let d = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(ShapeError::Mismatch {
                    op,
                    lhs: a.to_vec(),
                    rhs: b.to_vec(),
                });
            }
        };
        out.push(d);
    }
    Ok(out)
}

/// The `k`-th dim counting from the right (0 = last), 1 past the rank.
fn dim_from_right(shape: &[usize], k: usize) -> usize {
    if k < shape.len() {
        shape[shape.len() - 1 - k]
    } else {
        1
    }
}

/// Strides that read a tensor of `shape` as if it had the broadcast shape `out` (0 on
/// broadcast dims). `shape` must broadcast to `out`.
pub(crate) fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let own = contiguous_strides(shape);
    let offset = out.len() - shape.len();
    (0..out.len())
        .map(|i| {
            if i < offset || shape[i - offset] == 1 {
                0
            } else {
                own[i - offset]
            }
        })
        .collect()
}

/// Visits every index of `out_shape` in row-major order, calling `f` with the offsets given
/// by the two stride vectors.
pub(crate) fn for_each_offset2(
    out_shape: &[usize],
    sa: &[usize],
    sb: &[usize],
    mut f: impl FnMut(usize, usize),
) {
    if out_shape.contains(&0) {
        return;
    }
    let rank = out_shape.len();
    if rank == 0 {
        f(0, 0);
        return;
    }
    let inner = out_shape[rank - 1];
    let (ia, ib) = (sa[rank - 1], sb[rank - 1]);
    let mut idx = vec![0usize; rank - 1];
    let (mut oa, mut ob) = (0usize, 0usize);
    loop {
        for k in 0..inner {
            f(oa + k * ia, ob + k * ib);
        }
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            oa += sa[d];
            ob += sb[d];
            if idx[d] < out_shape[d] {
                break;
            }
            oa -= sa[d] * out_shape[d];
            ob -= sb[d] * out_shape[d];
            idx[d] = 0;
        }
    }
}

/// Gathers the elements of `data` read with `strides` over `out_shape`, in row-major order.
pub(crate) fn gather<T: Copy>(data: &[T], out_shape: &[usize], strides: &[usize]) -> Vec<T> {
    let mut out = Vec::with_capacity(checked_numel(out_shape).unwrap_or(0));
    for_each_offset2(out_shape, strides, strides, |o, _| out.push(data[o]));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_and_numel() {
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(contiguous_strides(&[]), Vec::<usize>::new());
        assert_eq!(checked_numel(&[]), Some(1));
        assert_eq!(checked_numel(&[2, 0, 5]), Some(0));
        assert_eq!(checked_numel(&[usize::MAX, 2]), None);
    }

    #[test]
    fn broadcasting() {
        assert_eq!(
            broadcast_shapes("t", &[2, 1, 4], &[3, 1]).unwrap(),
            vec![2, 3, 4]
        );
        assert_eq!(broadcast_shapes("t", &[], &[3]).unwrap(), vec![3]);
        assert!(broadcast_shapes("t", &[2, 3], &[4, 3]).is_err());
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
    }
}
