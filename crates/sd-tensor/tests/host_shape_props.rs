//! Property tests of the host tensor shape operations.

use proptest::prelude::*;
use sd_tensor::host::Tensor;

/// A shape of rank 1 to 4 with dims 1 to 4, and a tensor of distinct values of that shape.
fn tensor() -> impl Strategy<Value = Tensor<f32>> {
    prop::collection::vec(1usize..5, 1..5).prop_map(|shape| {
        Tensor::from_fn(shape, {
            let mut k = 0f32;
            move |_| {
                k += 1.0;
                k
            }
        })
        .unwrap()
    })
}

/// A tensor and a permutation of its dims.
fn tensor_and_perm() -> impl Strategy<Value = (Tensor<f32>, Vec<usize>)> {
    tensor().prop_flat_map(|t| {
        let rank = t.rank();
        (Just(t), Just((0..rank).collect::<Vec<_>>()).prop_shuffle())
    })
}

fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

proptest! {
    #[test]
    fn host_permute_then_inverse_is_identity((t, perm) in tensor_and_perm()) {
        let p = t.permute(&perm).unwrap();
        for (i, &d) in perm.iter().enumerate() {
            prop_assert_eq!(p.shape()[i], t.shape()[d]);
        }
        prop_assert_eq!(p.permute(&inverse(&perm)).unwrap(), t);
    }

    #[test]
    fn host_permute_moves_elements((t, perm) in tensor_and_perm()) {
        let p = t.permute(&perm).unwrap();
        let out_shape = p.shape().to_vec();
        let check = Tensor::from_fn(out_shape, |idx| {
            let mut src = vec![0; idx.len()];
            for (i, &d) in perm.iter().enumerate() {
                src[d] = idx[i];
            }
            *t.at(&src).unwrap()
        }).unwrap();
        prop_assert_eq!(p, check);
    }

    #[test]
    fn host_concat_then_slice_gives_parts(t in tensor(), dim_seed in 0usize..4, extra in prop::collection::vec(1usize..4, 1..4)) {
        let dim = dim_seed % t.rank();
        let mut parts = vec![t.clone()];
        for (k, &n) in extra.iter().enumerate() {
            let mut shape = t.shape().to_vec();
            shape[dim] = n;
            parts.push(Tensor::from_fn(shape, |i| (k * 1000 + i.iter().sum::<usize>()) as f32).unwrap());
        }
        let refs: Vec<&Tensor<f32>> = parts.iter().collect();
        let cat = Tensor::concat(&refs, dim).unwrap();
        let total: usize = parts.iter().map(|p| p.shape()[dim]).sum();
        prop_assert_eq!(cat.shape()[dim], total);
        let mut start = 0;
        for p in &parts {
            let end = start + p.shape()[dim];
            prop_assert_eq!(&cat.slice(dim, start, end).unwrap(), p);
            start = end;
        }
        let sizes: Vec<usize> = parts.iter().map(|p| p.shape()[dim]).collect();
        if sizes.iter().all(|&s| s == sizes[0]) {
            prop_assert_eq!(cat.split(sizes[0], dim).unwrap(), parts);
        }
    }

    #[test]
    fn host_reshape_preserves_data(t in tensor(), split in 1usize..4) {
        let n = t.numel();
        let flat = t.clone().reshape([n]).unwrap();
        prop_assert_eq!(flat.data(), t.data());
        if n % split == 0 {
            let r = t.clone().reshape([split, n / split]).unwrap();
            prop_assert_eq!(r.data(), t.data());
            prop_assert_eq!(r.reshape(t.shape()).unwrap(), t.clone());
        }
        prop_assert!(t.clone().reshape([n + 1]).is_err());
    }

    #[test]
    fn host_stack_then_get_gives_parts(t in tensor(), n in 1usize..4) {
        let parts: Vec<Tensor<f32>> = (0..n).map(|k| t.add_scalar(k as f32 * 100.0)).collect();
        let refs: Vec<&Tensor<f32>> = parts.iter().collect();
        let s = Tensor::stack(&refs, 0).unwrap();
        for (k, p) in parts.iter().enumerate() {
            prop_assert_eq!(&s.get(k).unwrap(), p);
        }
        let last = t.rank();
        let s = Tensor::stack(&refs, last).unwrap();
        for (k, p) in parts.iter().enumerate() {
            prop_assert_eq!(&s.slice(last, k, k + 1).unwrap().squeeze(last).unwrap(), p);
        }
    }

    #[test]
    fn host_transpose_twice_is_identity(t in tensor(), a in 0usize..4, b in 0usize..4) {
        let (a, b) = (a % t.rank(), b % t.rank());
        prop_assert_eq!(t.transpose(a, b).unwrap().transpose(a, b).unwrap(), t);
    }

    #[test]
    fn host_pad_then_slice_is_identity(t in tensor(), dim in 0usize..4, before in 0usize..3, after in 0usize..3) {
        let dim = dim % t.rank();
        let p = t.pad(dim, before, after, -7.0).unwrap();
        let size = t.shape()[dim];
        prop_assert_eq!(p.slice(dim, before, before + size).unwrap(), t.clone());
        let pads = p.numel() - t.numel();
        prop_assert_eq!(p.data().iter().filter(|&&v| v == -7.0).count(), pads);
    }

    #[test]
    fn host_broadcast_add_matches_explicit(t in tensor(), dim in 0usize..4) {
        let dim = dim % t.rank();
        let row = t.slice(dim, 0, 1).unwrap();
        let sum = t.add(&row).unwrap();
        let explicit = t.add(&row.broadcast_to(t.shape()).unwrap()).unwrap();
        prop_assert_eq!(sum, explicit);
        let rev = row.add(&t).unwrap();
        prop_assert_eq!(rev.shape(), t.shape());
    }
}

#[test]
fn host_shape_errors_name_shapes() {
    let a = Tensor::<f32>::zeros([2, 3]).unwrap();
    let b = Tensor::<f32>::zeros([4, 3]).unwrap();
    let msg = a.add(&b).unwrap_err().to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[4, 3]"), "{msg}");
    let msg = Tensor::concat(&[&a, &Tensor::zeros([2, 4]).unwrap()], 0)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[2, 4]"), "{msg}");
    let msg = a.permute(&[1, 1]).unwrap_err().to_string();
    assert!(msg.contains("[1, 1]") && msg.contains("[2, 3]"), "{msg}");
    let msg = a.clone().reshape([5]).unwrap_err().to_string();
    assert!(msg.contains("[2, 3]") && msg.contains("[5]"), "{msg}");
}
