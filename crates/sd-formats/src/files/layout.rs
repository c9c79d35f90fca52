//! Checks shared by every reader: shape arithmetic, byte sizes, bounds and overlaps.

use sd_tensor::DType;

use super::error::{Ctx, FileError};

/// Most dimensions a tensor may have (PyTorch allows more, no diffusion model uses them).
pub const MAX_DIMS: usize = 8;

/// Element count of `shape`, with checked arithmetic.
pub(crate) fn numel(ctx: &Ctx, tensor: &str, shape: &[u64]) -> Result<u64, FileError> {
    if shape.len() > MAX_DIMS {
        return Err(ctx.bad_tensor(
            tensor,
            format!("{} dimensions (at most {MAX_DIMS})", shape.len()),
        ));
    }
    shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| {
            ctx.bad_tensor(
                tensor,
                format!("the element count of shape {shape:?} overflows"),
            )
        })
}

/// Bytes taken by a contiguous tensor of `dtype` and `shape` (outermost first). Quantized
/// types need an innermost dimension of whole blocks.
pub(crate) fn byte_size(
    ctx: &Ctx,
    tensor: &str,
    dtype: DType,
    shape: &[u64],
) -> Result<u64, FileError> {
    let n = numel(ctx, tensor, shape)?;
    let block = dtype.block_size() as u64;
    if block > 1 {
        let row = shape.last().copied().unwrap_or(1);
        if row % block != 0 {
            return Err(ctx.bad_tensor(
                tensor,
                format!(
                    "innermost dimension {row} is not a multiple of the {dtype} block size {block}"
                ),
            ));
        }
    }
    (n / block)
        .checked_mul(dtype.type_size() as u64)
        .ok_or_else(|| {
            ctx.bad_tensor(
                tensor,
                format!("the byte size of shape {shape:?} overflows"),
            )
        })
}

/// Checks that `offset..offset + size` lies inside `0..limit`; returns the end.
pub(crate) fn check_bounds(
    ctx: &Ctx,
    tensor: &str,
    offset: u64,
    size: u64,
    limit: u64,
) -> Result<u64, FileError> {
    match offset.checked_add(size) {
        Some(end) if end <= limit => Ok(end),
        _ => Err(FileError::OutOfBounds {
            path: ctx.p(),
            tensor: tensor.to_string(),
            offset,
            size,
            limit,
        }),
    }
}

/// A byte range owned by one tensor (or one PyTorch storage, which several tensors may view).
#[derive(Clone, Debug)]
pub(crate) struct Span {
    pub start: u64,
    pub end: u64,
    /// Tensor named in an overlap error.
    pub name: String,
}

/// Errors if two non-empty spans overlap, naming a tensor of each.
pub(crate) fn check_overlaps(ctx: &Ctx, mut spans: Vec<Span>) -> Result<(), FileError> {
    spans.retain(|s| s.end > s.start);
    spans.sort_by_key(|s| (s.start, s.end));
    let mut widest: Option<&Span> = None;
    for s in &spans {
        if let Some(w) = widest {
            if s.start < w.end {
                return Err(FileError::Overlap {
                    path: ctx.p(),
                    first: w.name.clone(),
                    second: s.name.clone(),
                });
            }
        }
        if widest.is_none_or(|w| s.end > w.end) {
            widest = Some(s);
        }
    }
    Ok(())
}

/// Errors on a name that appears twice.
pub(crate) fn check_unique<'n>(
    ctx: &Ctx,
    names: impl Iterator<Item = &'n str>,
) -> Result<(), FileError> {
    let mut seen = std::collections::HashSet::new();
    for n in names {
        if !seen.insert(n) {
            return Err(ctx.duplicate(n));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn span(start: u64, end: u64, name: &str) -> Span {
        Span {
            start,
            end,
            name: name.into(),
        }
    }

    #[test]
    fn overlaps_are_found_past_a_wide_span() {
        let ctx = Ctx::new(Path::new("x"));
        assert!(check_overlaps(
            &ctx,
            vec![span(0, 4, "a"), span(4, 8, "b"), span(8, 8, "c")]
        )
        .is_ok());
        let e = check_overlaps(
            &ctx,
            vec![span(0, 100, "a"), span(10, 20, "b"), span(50, 60, "c")],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("`a`") && e.to_string().contains("`b`"),
            "{e}"
        );
        let e = check_overlaps(
            &ctx,
            vec![span(0, 10, "a"), span(10, 20, "b"), span(15, 16, "c")],
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("`b`") && e.to_string().contains("`c`"),
            "{e}"
        );
    }

    #[test]
    fn sizes_use_rows_of_blocks() {
        let ctx = Ctx::new(Path::new("x"));
        assert_eq!(byte_size(&ctx, "t", DType::Q8_0, &[2, 64]).unwrap(), 2 * 68);
        assert!(byte_size(&ctx, "t", DType::Q8_0, &[64, 2]).is_err());
        assert_eq!(byte_size(&ctx, "t", DType::F16, &[]).unwrap(), 2);
        assert!(byte_size(&ctx, "t", DType::F32, &[u64::MAX, 2]).is_err());
        assert!(byte_size(&ctx, "t", DType::F64, &[u64::MAX / 4]).is_err());
    }
}
