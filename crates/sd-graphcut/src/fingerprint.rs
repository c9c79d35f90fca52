//! Structural fingerprints of graphs: the key of the plan cache.
//!
//! The fingerprint covers everything a plan depends on: for every leaf and node its op, op
//! parameters, type, dimensions, strides, flags, source slots and view source (as
//! positions), view offset, parameter classification and cut name. It leaves out what does
//! not change a plan: tensor names, addresses, contexts, data and mark locations. Two
//! captures of the same model code with the same shapes therefore share a fingerprint; any
//! structural change gives a different one (up to 128-bit hash collisions).

use std::fmt;

use crate::view::{TensorDesc, TensorRef};

/// A 128-bit structural fingerprint of a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fingerprint(pub u128);

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// Two independent 64-bit lanes of a multiply-rotate hash, finalised with a 64-bit mix.
struct Hasher {
    a: u64,
    b: u64,
}

const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xC2B2_AE3D_27D4_EB4F;

impl Hasher {
    fn new() -> Hasher {
        Hasher {
            a: 0x243F_6A88_85A3_08D3,
            b: 0x1319_8A2E_0370_7344,
        }
    }

    #[inline]
    fn word(&mut self, w: u64) {
        self.a = (self.a ^ w).wrapping_mul(K1).rotate_left(31);
        self.b = (self.b.rotate_left(23) ^ w.wrapping_mul(K2)).wrapping_mul(K1 ^ 0x5555);
    }

    fn bytes(&mut self, s: &[u8]) {
        self.word(s.len() as u64);
        for chunk in s.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.word(u64::from_le_bytes(w));
        }
    }

    fn finish(self) -> Fingerprint {
        fn mix(mut x: u64) -> u64 {
            x ^= x >> 33;
            x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
            x ^= x >> 33;
            x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
            x ^ (x >> 33)
        }
        let hi = mix(self.a ^ self.b.rotate_left(17));
        let lo = mix(self.b ^ hi);
        Fingerprint(((hi as u128) << 64) | lo as u128)
    }
}

fn tref(r: Option<TensorRef>) -> u64 {
    match r {
        None => 0,
        Some(TensorRef::Leaf(i)) => ((i as u64) << 2) | 1,
        Some(TensorRef::Node(i)) => ((i as u64) << 2) | 2,
    }
}

fn tensor(h: &mut Hasher, d: &TensorDesc) {
    h.word(((d.op as u64) << 32) | d.dtype as u64);
    for i in 0..4 {
        h.word(d.ne[i] as u64);
        h.word(d.nb[i] as u64);
    }
    for pair in d.op_params.chunks(2) {
        h.word(((pair[0] as u32 as u64) << 32) | pair[1] as u32 as u64);
    }
    h.word(((d.flags as u32 as u64) << 1) | d.is_param as u64);
    h.word(d.srcs.len() as u64);
    for s in &d.srcs {
        h.word(tref(*s));
    }
    h.word(tref(d.view_src));
    h.word(d.view_offs as u64);
    match &d.cut {
        None => h.word(0),
        Some(c) => {
            h.word(1);
            h.bytes(c.name.group().as_bytes());
            h.bytes(c.name.output().as_bytes());
        }
    }
}

/// The fingerprint of a graph given as leaves and nodes.
pub(crate) fn fingerprint(leaves: &[TensorDesc], nodes: &[TensorDesc]) -> Fingerprint {
    let mut h = Hasher::new();
    h.word(leaves.len() as u64);
    h.word(nodes.len() as u64);
    for l in leaves {
        tensor(&mut h, l);
    }
    for n in nodes {
        tensor(&mut h, n);
    }
    h.finish()
}
