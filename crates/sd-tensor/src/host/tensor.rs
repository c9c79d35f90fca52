//! The host tensor: an owned, row-major array with a shape.

use std::fmt;

use super::element::Element;
use super::shape::{
    broadcast_shapes, broadcast_strides, checked_numel, contiguous_strides, gather, ShapeError,
};

/// Result of the host tensor operations.
pub type Result<T, E = ShapeError> = std::result::Result<T, E>;

/// An owned host tensor: elements in row-major order, shape outermost first (`[N, C, H, W]`
/// for images and latents).
///
/// Rank 0 is allowed (one element). Operations that only change the shape (`reshape`,
/// `squeeze`, `unsqueeze`) consume the tensor; the others borrow it and return a new one.
/// Every shape mismatch is a [`ShapeError`], never a panic.
#[derive(Clone, PartialEq)]
pub struct Tensor<T> {
    shape: Vec<usize>,
    data: Vec<T>,
}

impl<T> Tensor<T> {
    /// A tensor of `shape` holding `data` (row-major); the lengths must agree.
    pub fn new(shape: impl Into<Vec<usize>>, data: Vec<T>) -> Result<Self> {
        let shape = shape.into();
        let expected = checked_numel(&shape).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        if expected != data.len() {
            return Err(ShapeError::DataLength {
                shape,
                expected,
                got: data.len(),
            });
        }
        Ok(Tensor { shape, data })
    }

    /// A 1-D tensor holding `data`.
    pub fn from_vec(data: Vec<T>) -> Self {
        Tensor {
            shape: vec![data.len()],
            data,
        }
    }

    /// A rank-0 tensor holding one value.
    pub fn scalar(value: T) -> Self {
        Tensor {
            shape: Vec::new(),
            data: vec![value],
        }
    }

    /// A tensor whose element at each index is `f(index)`.
    pub fn from_fn(shape: impl Into<Vec<usize>>, mut f: impl FnMut(&[usize]) -> T) -> Result<Self> {
        let shape = shape.into();
        let n = checked_numel(&shape).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        let mut data = Vec::with_capacity(n);
        let mut idx = vec![0usize; shape.len()];
        for _ in 0..n {
            data.push(f(&idx));
            for d in (0..shape.len()).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Ok(Tensor { shape, data })
    }

    /// Shape, outermost dimension first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Elements in row-major order.
    pub fn data(&self) -> &[T] {
        &self.data
    }

    /// Elements in row-major order, mutable (the shape stays fixed).
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }

    /// The elements, giving up the shape.
    pub fn into_data(self) -> Vec<T> {
        self.data
    }

    /// Shape and elements.
    pub fn into_parts(self) -> (Vec<usize>, Vec<T>) {
        (self.shape, self.data)
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Whether the tensor holds no element.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// Size of dimension `dim`.
    pub fn dim(&self, dim: usize) -> Result<usize> {
        self.shape
            .get(dim)
            .copied()
            .ok_or_else(|| self.dim_err("dim", dim))
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        contiguous_strides(&self.shape)
    }

    /// Row-major offset of a full index, or `None` when it is out of bounds.
    pub fn offset_of(&self, index: &[usize]) -> Option<usize> {
        if index.len() != self.shape.len() {
            return None;
        }
        let mut off = 0usize;
        for (&i, &d) in index.iter().zip(&self.shape) {
            if i >= d {
                return None;
            }
            off = off * d + i;
        }
        Some(off)
    }

    /// The element at a full index.
    pub fn at(&self, index: &[usize]) -> Option<&T> {
        self.offset_of(index).map(|o| &self.data[o])
    }

    /// The element at a full index, mutable.
    pub fn at_mut(&mut self, index: &[usize]) -> Option<&mut T> {
        self.offset_of(index).map(move |o| &mut self.data[o])
    }

    /// The same elements with another shape of the same element count.
    pub fn reshape(self, shape: impl Into<Vec<usize>>) -> Result<Self> {
        let to = shape.into();
        if checked_numel(&to) != Some(self.data.len()) {
            return Err(ShapeError::Reshape {
                from: self.shape,
                to,
            });
        }
        Ok(Tensor {
            shape: to,
            data: self.data,
        })
    }

    /// Inserts a dimension of size 1 at `dim` (`0..=rank`).
    pub fn unsqueeze(mut self, dim: usize) -> Result<Self> {
        if dim > self.shape.len() {
            return Err(self.dim_err("unsqueeze", dim));
        }
        self.shape.insert(dim, 1);
        Ok(self)
    }

    /// Removes dimension `dim`, which must have size 1.
    pub fn squeeze(mut self, dim: usize) -> Result<Self> {
        match self.shape.get(dim) {
            Some(1) => {
                self.shape.remove(dim);
                Ok(self)
            }
            Some(&d) => Err(ShapeError::Invalid {
                op: "squeeze",
                shape: self.shape.clone(),
                detail: format!("dim {dim} has size {d}, not 1"),
            }),
            None => Err(self.dim_err("squeeze", dim)),
        }
    }

    /// Elements mapped one by one.
    pub fn map<U>(&self, f: impl FnMut(&T) -> U) -> Tensor<U> {
        Tensor {
            shape: self.shape.clone(),
            data: self.data.iter().map(f).collect(),
        }
    }

    /// Maps every element in place.
    pub fn map_inplace(&mut self, mut f: impl FnMut(&T) -> T) {
        for v in &mut self.data {
            *v = f(v);
        }
    }

    pub(crate) fn dim_err(&self, op: &'static str, dim: usize) -> ShapeError {
        ShapeError::DimOutOfRange {
            op,
            dim,
            shape: self.shape.clone(),
        }
    }

    /// (outer, size, inner) around `dim`: elements before, along and after it.
    fn split_at_dim(&self, op: &'static str, dim: usize) -> Result<(usize, usize, usize)> {
        if dim >= self.shape.len() {
            return Err(self.dim_err(op, dim));
        }
        let outer = self.shape[..dim].iter().product();
        let inner = self.shape[dim + 1..].iter().product();
        Ok((outer, self.shape[dim], inner))
    }
}

impl<T: Copy> Tensor<T> {
    /// A tensor of `shape` with every element `value`.
    pub fn full(shape: impl Into<Vec<usize>>, value: T) -> Result<Self> {
        let shape = shape.into();
        let n = checked_numel(&shape).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        Ok(Tensor {
            shape,
            data: vec![value; n],
        })
    }

    /// Elements of two tensors combined one by one, broadcasting dims of size 1 (numpy rules).
    pub fn zip_map<U: Copy, V>(
        &self,
        other: &Tensor<U>,
        mut f: impl FnMut(T, U) -> V,
    ) -> Result<Tensor<V>> {
        if self.shape == other.shape {
            let data = self
                .data
                .iter()
                .zip(&other.data)
                .map(|(&a, &b)| f(a, b))
                .collect();
            return Ok(Tensor {
                shape: self.shape.clone(),
                data,
            });
        }
        let shape = broadcast_shapes("zip_map", &self.shape, &other.shape)?;
        let sa = broadcast_strides(&self.shape, &shape);
        let sb = broadcast_strides(&other.shape, &shape);
        let mut data = Vec::with_capacity(checked_numel(&shape).unwrap_or(0));
        super::shape::for_each_offset2(&shape, &sa, &sb, |oa, ob| {
            data.push(f(self.data[oa], other.data[ob]))
        });
        Ok(Tensor { shape, data })
    }

    /// The tensor repeated along dims of size 1 (and new leading dims) to `shape`.
    pub fn broadcast_to(&self, shape: impl Into<Vec<usize>>) -> Result<Self> {
        let shape = shape.into();
        let ok = shape.len() >= self.shape.len()
            && self
                .shape
                .iter()
                .rev()
                .zip(shape.iter().rev())
                .all(|(&s, &o)| s == o || s == 1);
        if !ok {
            return Err(ShapeError::Mismatch {
                op: "broadcast_to",
                lhs: self.shape.clone(),
                rhs: shape,
            });
        }
        checked_numel(&shape).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        let strides = broadcast_strides(&self.shape, &shape);
        let data = gather(&self.data, &shape, &strides);
        Ok(Tensor { shape, data })
    }

    /// The elements `start..end` along `dim` (torch `narrow`).
    pub fn slice(&self, dim: usize, start: usize, end: usize) -> Result<Self> {
        let (outer, size, inner) = self.split_at_dim("slice", dim)?;
        if start > end || end > size {
            return Err(ShapeError::OutOfRange {
                op: "slice",
                dim,
                start,
                end,
                shape: self.shape.clone(),
            });
        }
        let mut shape = self.shape.clone();
        shape[dim] = end - start;
        let mut data = Vec::with_capacity(outer * (end - start) * inner);
        for o in 0..outer {
            let base = o * size * inner;
            data.extend_from_slice(&self.data[base + start * inner..base + end * inner]);
        }
        Ok(Tensor { shape, data })
    }

    /// The sub-tensor at `index` along dim 0, without that dim (`t[index]` in torch).
    pub fn get(&self, index: usize) -> Result<Self> {
        if self.shape.is_empty() {
            return Err(self.dim_err("get", 0));
        }
        if index >= self.shape[0] {
            return Err(ShapeError::OutOfRange {
                op: "get",
                dim: 0,
                start: index,
                end: index + 1,
                shape: self.shape.clone(),
            });
        }
        let inner: usize = self.shape[1..].iter().product();
        Ok(Tensor {
            shape: self.shape[1..].to_vec(),
            data: self.data[index * inner..(index + 1) * inner].to_vec(),
        })
    }

    /// The entries `indices` along `dim`, in that order (repeats allowed; torch `index_select`).
    pub fn index_select(&self, dim: usize, indices: &[usize]) -> Result<Self> {
        let (outer, size, inner) = self.split_at_dim("index_select", dim)?;
        if let Some(&bad) = indices.iter().find(|&&i| i >= size) {
            return Err(ShapeError::OutOfRange {
                op: "index_select",
                dim,
                start: bad,
                end: bad + 1,
                shape: self.shape.clone(),
            });
        }
        let mut shape = self.shape.clone();
        shape[dim] = indices.len();
        let mut data = Vec::with_capacity(outer * indices.len() * inner);
        for o in 0..outer {
            for &i in indices {
                let base = (o * size + i) * inner;
                data.extend_from_slice(&self.data[base..base + inner]);
            }
        }
        Ok(Tensor { shape, data })
    }

    /// Splits along `dim` into pieces of `size` (the last may be smaller; torch `split`).
    pub fn split(&self, size: usize, dim: usize) -> Result<Vec<Self>> {
        let len = self.dim(dim).map_err(|_| self.dim_err("split", dim))?;
        if size == 0 {
            return Err(ShapeError::Invalid {
                op: "split",
                shape: self.shape.clone(),
                detail: "piece size 0".into(),
            });
        }
        (0..len.div_ceil(size))
            .map(|i| self.slice(dim, i * size, ((i + 1) * size).min(len)))
            .collect()
    }

    /// Splits along `dim` into `n` pieces of `ceil(len / n)` (fewer when they run out; torch
    /// `chunk`).
    pub fn chunk(&self, n: usize, dim: usize) -> Result<Vec<Self>> {
        let len = self.dim(dim).map_err(|_| self.dim_err("chunk", dim))?;
        if n == 0 {
            return Err(ShapeError::Invalid {
                op: "chunk",
                shape: self.shape.clone(),
                detail: "0 chunks".into(),
            });
        }
        if len == 0 {
            return Ok(vec![self.clone()]);
        }
        self.split(len.div_ceil(n), dim)
    }

    /// Concatenates tensors along `dim`; all other dims must agree.
    pub fn concat(parts: &[&Tensor<T>], dim: usize) -> Result<Self> {
        let first = parts.first().ok_or(ShapeError::Empty { op: "concat" })?;
        let (outer, _, inner) = first.split_at_dim("concat", dim)?;
        let mut total = 0usize;
        for p in parts {
            let same = p.shape.len() == first.shape.len()
                && p.shape
                    .iter()
                    .zip(&first.shape)
                    .enumerate()
                    .all(|(i, (a, b))| i == dim || a == b);
            if !same {
                return Err(ShapeError::Mismatch {
                    op: "concat",
                    lhs: first.shape.clone(),
                    rhs: p.shape.clone(),
                });
            }
            total += p.shape[dim];
        }
        let mut shape = first.shape.clone();
        shape[dim] = total;
        let mut data = Vec::with_capacity(outer * total * inner);
        for o in 0..outer {
            for p in parts {
                let chunk = p.shape[dim] * inner;
                data.extend_from_slice(&p.data[o * chunk..(o + 1) * chunk]);
            }
        }
        Ok(Tensor { shape, data })
    }

    /// Stacks tensors of one shape along a new dimension `dim` (`0..=rank`).
    pub fn stack(parts: &[&Tensor<T>], dim: usize) -> Result<Self> {
        let first = parts.first().ok_or(ShapeError::Empty { op: "stack" })?;
        if dim > first.shape.len() {
            return Err(first.dim_err("stack", dim));
        }
        if let Some(p) = parts.iter().find(|p| p.shape != first.shape) {
            return Err(ShapeError::Mismatch {
                op: "stack",
                lhs: first.shape.clone(),
                rhs: p.shape.clone(),
            });
        }
        let outer: usize = first.shape[..dim].iter().product();
        let inner: usize = first.shape[dim..].iter().product();
        let mut shape = first.shape.clone();
        shape.insert(dim, parts.len());
        let mut data = Vec::with_capacity(outer * parts.len() * inner);
        for o in 0..outer {
            for p in parts {
                data.extend_from_slice(&p.data[o * inner..(o + 1) * inner]);
            }
        }
        Ok(Tensor { shape, data })
    }

    /// Reorders the dims: output dim `i` is input dim `perm[i]` (torch `permute`).
    pub fn permute(&self, perm: &[usize]) -> Result<Self> {
        let rank = self.shape.len();
        let mut seen = vec![false; rank];
        let valid = perm.len() == rank
            && perm
                .iter()
                .all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
        if !valid {
            return Err(ShapeError::Permutation {
                op: "permute",
                perm: perm.to_vec(),
                shape: self.shape.clone(),
            });
        }
        let src = contiguous_strides(&self.shape);
        let shape: Vec<usize> = perm.iter().map(|&p| self.shape[p]).collect();
        let strides: Vec<usize> = perm.iter().map(|&p| src[p]).collect();
        let data = gather(&self.data, &shape, &strides);
        Ok(Tensor { shape, data })
    }

    /// Swaps dims `a` and `b`.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        let rank = self.shape.len();
        if a >= rank || b >= rank {
            return Err(self.dim_err("transpose", a.max(b)));
        }
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        self.permute(&perm)
    }

    /// Pads dim `dim` with `before` and `after` copies of `value` (constant padding).
    pub fn pad(&self, dim: usize, before: usize, after: usize, value: T) -> Result<Self> {
        let (outer, size, inner) = self.split_at_dim("pad", dim)?;
        let mut shape = self.shape.clone();
        shape[dim] = size
            .checked_add(before)
            .and_then(|s| s.checked_add(after))
            .ok_or_else(|| ShapeError::Overflow {
                shape: self.shape.clone(),
            })?;
        let n = checked_numel(&shape).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        let mut data = Vec::with_capacity(n);
        for o in 0..outer {
            data.extend(std::iter::repeat_n(value, before * inner));
            data.extend_from_slice(&self.data[o * size * inner..(o + 1) * size * inner]);
            data.extend(std::iter::repeat_n(value, after * inner));
        }
        Ok(Tensor { shape, data })
    }
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` filled with zeros.
    pub fn zeros(shape: impl Into<Vec<usize>>) -> Result<Self> {
        Self::full(shape, T::from_f32(0.0))
    }

    /// A tensor of `shape` filled with ones.
    pub fn ones(shape: impl Into<Vec<usize>>) -> Result<Self> {
        Self::full(shape, T::from_f32(1.0))
    }

    /// The elements converted to f32.
    pub fn to_f32(&self) -> Tensor<f32> {
        self.map(|v| v.to_f32())
    }

    /// An f32 tensor converted to this element type (f16/bf16 round to nearest even).
    pub fn from_f32(t: &Tensor<f32>) -> Self {
        t.map(|&v| T::from_f32(v))
    }

    /// The elements converted to another element type through f32.
    pub fn cast<U: Element>(&self) -> Tensor<U> {
        self.map(|v| U::from_f32(v.to_f32()))
    }

    /// The elements as little-endian bytes (the layout ggml and safetensors use).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.data.len() * T::SIZE);
        for &v in &self.data {
            v.write_le(&mut out);
        }
        out
    }

    /// A tensor of `shape` decoded from little-endian bytes of `T`.
    pub fn from_le_bytes(shape: impl Into<Vec<usize>>, bytes: &[u8]) -> Result<Self> {
        let shape = shape.into();
        let n = checked_numel(&shape).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        let expected = n.checked_mul(T::SIZE).ok_or_else(|| ShapeError::Overflow {
            shape: shape.clone(),
        })?;
        if bytes.len() != expected {
            return Err(ShapeError::ByteLength {
                shape,
                dtype: T::DTYPE,
                expected,
                got: bytes.len(),
            });
        }
        let data = bytes.chunks_exact(T::SIZE).map(T::read_le).collect();
        Ok(Tensor { shape, data })
    }
}

/// Elements shown by `Debug` before eliding the rest.
const DEBUG_ELEMENTS: usize = 32;

impl<T: fmt::Debug> fmt::Debug for Tensor<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor<{}>{:?} ", std::any::type_name::<T>(), self.shape)?;
        let shown = &self.data[..self.data.len().min(DEBUG_ELEMENTS)];
        let mut list = f.debug_list();
        list.entries(shown);
        if self.data.len() > shown.len() {
            list.entry(&format_args!("... {} more", self.data.len() - shown.len()));
        }
        list.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> Tensor<f32> {
        let n = shape.iter().product::<usize>();
        Tensor::new(shape, (0..n).map(|i| i as f32).collect()).unwrap()
    }

    #[test]
    fn new_checks_length() {
        let e = Tensor::new([2, 3], vec![0f32; 5]).unwrap_err();
        assert_eq!(
            e,
            ShapeError::DataLength {
                shape: vec![2, 3],
                expected: 6,
                got: 5
            }
        );
        assert!(e.to_string().contains("[2, 3]"));
        assert!(matches!(
            Tensor::<f32>::zeros([usize::MAX, 4]),
            Err(ShapeError::Overflow { .. })
        ));
        let s = Tensor::scalar(3.0f32);
        assert_eq!((s.rank(), s.numel()), (0, 1));
        assert_eq!(Tensor::new(vec![], vec![3.0f32]).unwrap(), s);
    }

    #[test]
    fn from_fn_indexes_row_major() {
        let t = Tensor::from_fn([2, 3], |i| (i[0] * 10 + i[1]) as i32).unwrap();
        assert_eq!(t.data(), &[0, 1, 2, 10, 11, 12]);
        assert_eq!(t.at(&[1, 2]), Some(&12));
        assert_eq!(t.at(&[2, 0]), None);
        assert_eq!(t.at(&[1]), None);
    }

    #[test]
    fn slice_get_and_index_select() {
        let t = iota(&[2, 3, 2]);
        let s = t.slice(1, 1, 3).unwrap();
        assert_eq!(s.shape(), &[2, 2, 2]);
        assert_eq!(s.data(), &[2., 3., 4., 5., 8., 9., 10., 11.]);
        assert!(t.slice(1, 2, 4).is_err());
        assert!(t.slice(3, 0, 1).is_err());
        assert_eq!(t.slice(1, 1, 1).unwrap().shape(), &[2, 0, 2]);
        let g = t.get(1).unwrap();
        assert_eq!(g.shape(), &[3, 2]);
        assert_eq!(g.data()[0], 6.0);
        assert!(t.get(2).is_err());
        let sel = t.index_select(2, &[1, 1, 0]).unwrap();
        assert_eq!(sel.shape(), &[2, 3, 3]);
        assert_eq!(&sel.data()[..6], &[1., 1., 0., 3., 3., 2.]);
        assert!(t.index_select(2, &[2]).is_err());
    }

    #[test]
    fn concat_stack_split() {
        let a = iota(&[2, 1, 2]);
        let b = iota(&[2, 2, 2]);
        let c = Tensor::concat(&[&a, &b], 1).unwrap();
        assert_eq!(c.shape(), &[2, 3, 2]);
        assert_eq!(c.data(), &[0., 1., 0., 1., 2., 3., 2., 3., 4., 5., 6., 7.]);
        assert!(Tensor::concat(&[&a, &b], 0).is_err());
        assert!(Tensor::<f32>::concat(&[], 0).is_err());
        let parts = c.split(2, 1).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].shape(), &[2, 1, 2]);
        assert_eq!(c.chunk(2, 1).unwrap().len(), 2);
        let s = Tensor::stack(&[&a, &a], 1).unwrap();
        assert_eq!(s.shape(), &[2, 2, 1, 2]);
        assert_eq!(s.data(), &[0., 1., 0., 1., 2., 3., 2., 3.]);
        assert!(Tensor::stack(&[&a, &b], 0).is_err());
        assert_eq!(Tensor::stack(&[&a, &a], 3).unwrap().shape(), &[2, 1, 2, 2]);
    }

    #[test]
    fn permute_transpose_pad() {
        let t = iota(&[2, 3]);
        let p = t.transpose(0, 1).unwrap();
        assert_eq!(p.shape(), &[3, 2]);
        assert_eq!(p.data(), &[0., 3., 1., 4., 2., 5.]);
        assert!(t.permute(&[0, 0]).is_err());
        assert!(t.permute(&[0]).is_err());
        assert!(t.permute(&[0, 2]).is_err());
        let q = t.pad(1, 1, 2, -1.0).unwrap();
        assert_eq!(q.shape(), &[2, 6]);
        assert_eq!(
            q.data(),
            &[-1., 0., 1., 2., -1., -1., -1., 3., 4., 5., -1., -1.]
        );
    }

    #[test]
    fn reshape_squeeze() {
        let t = iota(&[2, 3]);
        assert!(t.clone().reshape([4]).is_err());
        let r = t.clone().reshape([3, 1, 2]).unwrap();
        assert_eq!(r.data(), t.data());
        assert_eq!(r.clone().squeeze(1).unwrap().shape(), &[3, 2]);
        assert!(r.clone().squeeze(0).is_err());
        assert_eq!(r.unsqueeze(3).unwrap().shape(), &[3, 1, 2, 1]);
    }

    #[test]
    fn broadcasting() {
        let a = iota(&[2, 1, 3]);
        let b = iota(&[2, 1]);
        let c = a.zip_map(&b, |x, y| x * 10.0 + y).unwrap();
        assert_eq!(c.shape(), &[2, 2, 3]);
        assert_eq!(
            c.data(),
            &[0., 10., 20., 1., 11., 21., 30., 40., 50., 31., 41., 51.]
        );
        let d = b.broadcast_to([2, 2, 3]).unwrap();
        assert_eq!(d.data(), &[0., 0., 0., 1., 1., 1., 0., 0., 0., 1., 1., 1.]);
        assert!(a.broadcast_to([3]).is_err());
        assert!(a.zip_map(&iota(&[4]), |x, _| x).is_err());
    }

    #[test]
    fn casts_and_bytes() {
        let t = Tensor::new([3], vec![0.5f32, -1.25, 3.0]).unwrap();
        let h = Tensor::<half::f16>::from_f32(&t);
        assert_eq!(h.to_f32(), t);
        let bytes = h.to_le_bytes();
        assert_eq!(bytes.len(), 6);
        assert_eq!(Tensor::<half::f16>::from_le_bytes([3], &bytes).unwrap(), h);
        assert!(matches!(
            Tensor::<f32>::from_le_bytes([3], &bytes),
            Err(ShapeError::ByteLength { .. })
        ));
        assert_eq!(t.cast::<i32>().data(), &[0, -1, 3]);
    }

    #[test]
    fn debug_is_bounded() {
        let s = format!("{:?}", Tensor::<f32>::zeros([100]).unwrap());
        assert!(s.contains("68 more"), "{s}");
    }
}
