//! A restricted pickle virtual machine for PyTorch checkpoints.
//!
//! It understands the opcodes of protocols 0-5 that PyTorch writes (and a few more), and
//! **never executes anything**: a global is only a name looked up in an allowlist
//! ([`Global`]). Calling an allowlisted global builds a plain value (an `OrderedDict` becomes
//! a dict, `_rebuild_tensor_v2` a [`TensorRef`]); any other global is refused with
//! [`FileError::ForbiddenGlobal`], or, under [`GlobalPolicy::Inert`], becomes an inert
//! placeholder whose calls build nothing.
//!
//! Values live in an arena ([`Object`]s addressed by [`ObjId`]) so memo references keep
//! Python's sharing semantics without recursion: nothing here recurses on the input's
//! nesting, and cyclic structures are harmless.

use std::collections::HashMap;
use std::rc::Rc;

use sd_tensor::DType;

use super::error::{Ctx, FileError};
use super::source::Cursor;

/// Index of an [`Object`] in a [`Pickled`] arena.
pub type ObjId = u32;

/// What the VM does with a global outside its allowlist.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GlobalPolicy {
    /// Refuse the file with [`FileError::ForbiddenGlobal`] (the default).
    #[default]
    Strict,
    /// Accept globals from modules that are not known to be dangerous as inert placeholders
    /// (calling one builds an empty placeholder, nothing runs). Lightning checkpoints that
    /// store callback objects need this. Globals from modules such as `os`, `subprocess` or
    /// `builtins` are refused either way.
    Inert,
}

/// Options of one pickle run.
#[derive(Clone, Copy, Debug, Default)]
pub struct PickleOptions {
    /// Unknown globals.
    pub globals: GlobalPolicy,
    /// Whether persistent ids (PyTorch storages) are allowed.
    pub persistent: bool,
}

/// A PyTorch storage class: element type and size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageKind {
    /// The class name (`FloatStorage`, ...).
    pub name: &'static str,
    /// The element type, if sd-rs reads it.
    pub dtype: Option<DType>,
    /// Bytes per element.
    pub elsize: u64,
}

/// `torch.<Name>Storage` classes and PyTorch dtype names, with their element types.
const STORAGES: &[(&str, &str, Option<DType>, u64)] = &[
    ("DoubleStorage", "float64", Some(DType::F64), 8),
    ("FloatStorage", "float32", Some(DType::F32), 4),
    ("HalfStorage", "float16", Some(DType::F16), 2),
    ("BFloat16Storage", "bfloat16", Some(DType::BF16), 2),
    ("LongStorage", "int64", Some(DType::I64), 8),
    ("IntStorage", "int32", Some(DType::I32), 4),
    ("ShortStorage", "int16", Some(DType::I16), 2),
    ("CharStorage", "int8", Some(DType::I8), 1),
    ("ByteStorage", "uint8", None, 1),
    ("BoolStorage", "bool", None, 1),
    ("ComplexFloatStorage", "complex64", None, 8),
    ("ComplexDoubleStorage", "complex128", None, 16),
    ("Float8_e4m3fnStorage", "float8_e4m3fn", None, 1),
    ("Float8_e5m2Storage", "float8_e5m2", None, 1),
    ("UntypedStorage", "uint8", None, 1),
];

/// Other PyTorch dtype spellings (`torch.float`, `torch.half`, ...).
const DTYPE_ALIASES: &[(&str, &str)] = &[
    ("float", "float32"),
    ("double", "float64"),
    ("half", "float16"),
    ("long", "int64"),
    ("int", "int32"),
    ("short", "int16"),
];

/// Modules whose globals are refused even under [`GlobalPolicy::Inert`].
const DANGEROUS_MODULES: &[&str] = &[
    "os",
    "posix",
    "nt",
    "subprocess",
    "sys",
    "builtins",
    "__builtin__",
    "shutil",
    "socket",
    "importlib",
    "pickle",
    "_pickle",
    "marshal",
    "runpy",
    "code",
    "codeop",
    "pty",
    "ctypes",
    "webbrowser",
    "types",
    "functools",
    "operator",
    "io",
    "_io",
    "pathlib",
    "tempfile",
    "multiprocessing",
    "threading",
    "signal",
    "asyncio",
    "platform",
    "commands",
    "popen2",
    "requests",
    "urllib",
    "http",
    "ftplib",
    "telnetlib",
    "smtplib",
    "pdb",
    "bdb",
    "timeit",
    "trace",
    "cProfile",
    "profile",
    "inspect",
    "gc",
    "weakref",
    "copyreg",
    "copy_reg",
    "torch.hub",
    "torch.jit",
    "torch._C",
    "torch.ops",
    "numpy.testing",
];

/// An allowlisted global.
#[derive(Clone, Debug, PartialEq)]
pub enum Global {
    /// `collections.OrderedDict`
    OrderedDict,
    /// `torch._utils._rebuild_tensor_v2`
    RebuildTensorV2,
    /// `torch._utils._rebuild_tensor`
    RebuildTensor,
    /// `torch._utils._rebuild_parameter`
    RebuildParameter,
    /// `torch._utils._rebuild_parameter_with_state`
    RebuildParameterWithState,
    /// `torch._tensor._rebuild_from_type_v2`
    RebuildFromTypeV2,
    /// `torch.Size`
    TorchSize,
    /// `torch.Tensor`, `torch.nn.parameter.Parameter` (as the type argument of
    /// `_rebuild_from_type_v2`).
    TensorClass,
    /// A `torch.*Storage` class.
    Storage(StorageKind),
    /// A `torch.<dtype>` constant.
    Dtype(StorageKind),
    /// `_codecs.encode` (protocol 2 writes `bytes` through it).
    CodecsEncode,
    /// An unknown global accepted under [`GlobalPolicy::Inert`].
    Inert {
        /// Module.
        module: Rc<str>,
        /// Name.
        name: Rc<str>,
    },
}

/// A pickle value. Containers and tensors live in the arena ([`Value::Obj`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`
    None,
    /// `True` / `False`
    Bool(bool),
    /// An integer (at most 128 bits).
    Int(i128),
    /// A float.
    Float(f64),
    /// A string.
    Str(Rc<str>),
    /// Bytes.
    Bytes(Rc<[u8]>),
    /// An allowlisted global.
    Global(Global),
    /// An arena object.
    Obj(ObjId),
}

/// A PyTorch storage referenced through a persistent id.
#[derive(Clone, Debug, PartialEq)]
pub struct StorageRef {
    /// The storage key (zip entry `data/<key>`, or the legacy key).
    pub key: String,
    /// Storage class.
    pub kind: StorageKind,
    /// Device location string (`cpu`, `cuda:0`).
    pub location: String,
    /// Element count of the (root) storage.
    pub numel: u64,
    /// Legacy view of the root storage: element offset and element count.
    pub view: Option<(u64, u64)>,
}

/// A tensor built by `_rebuild_tensor_v2`.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorRef {
    /// The [`Object::Storage`] it views.
    pub storage: ObjId,
    /// Offset in elements.
    pub offset: u64,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
    /// Strides in elements.
    pub stride: Vec<u64>,
}

/// An arena object.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    /// A tuple.
    Tuple(Vec<Value>),
    /// A list (also sets).
    List(Vec<Value>),
    /// A dict (and `OrderedDict`): entries in insertion order; a key set twice appears twice,
    /// the later entry wins.
    Dict(Vec<(Value, Value)>),
    /// A storage from a persistent id.
    Storage(StorageRef),
    /// A tensor.
    Tensor(TensorRef),
    /// An object built from an inert global.
    Inert {
        /// Module of its class.
        module: Rc<str>,
        /// Name of its class.
        name: Rc<str>,
    },
}

/// The result of one pickle: the value `STOP` returned and the arena it refers to.
#[derive(Clone, Debug, Default)]
pub struct Pickled {
    /// The returned value.
    pub root: Option<Value>,
    /// All objects built.
    pub objects: Vec<Object>,
}

impl Pickled {
    /// The object behind an id.
    pub fn obj(&self, id: ObjId) -> Option<&Object> {
        self.objects.get(id as usize)
    }

    /// The object behind a value, if it is one.
    pub fn deref(&self, v: &Value) -> Option<&Object> {
        match v {
            Value::Obj(id) => self.obj(*id),
            _ => None,
        }
    }
}

/// The longest text line (GLOBAL names, text integers) accepted.
const MAX_LINE: usize = 4096;
/// Deepest nesting of `_rebuild_from_type_v2` calls.
const MAX_CALL_DEPTH: u32 = 4;

/// Runs the pickle at the start of `bytes` (up to its `STOP` opcode); `path` is only used in
/// messages.
pub fn unpickle(
    bytes: &[u8],
    path: &std::path::Path,
    opts: PickleOptions,
) -> Result<Pickled, FileError> {
    let ctx = Ctx::new(path);
    let src = &bytes;
    let mut cur = Cursor::new(src, ctx, 0, bytes.len() as u64);
    run(&mut cur, ctx, opts)
}

/// Runs one pickle from the cursor's position up to its `STOP` opcode.
pub(crate) fn run(cur: &mut Cursor, ctx: Ctx, opts: PickleOptions) -> Result<Pickled, FileError> {
    let mut vm = Vm {
        ctx,
        opts,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objects: Vec::new(),
        op: 0,
        budget: cur.remaining().saturating_mul(4).saturating_add(1 << 20),
    };
    let root = vm.run(cur)?;
    Ok(Pickled {
        root: Some(root),
        objects: vm.objects,
    })
}

struct Vm<'a> {
    ctx: Ctx<'a>,
    opts: PickleOptions,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    objects: Vec<Object>,
    /// Values that may still be copied (memo references make copies of shared containers
    /// possible; without a budget a small pickle could copy quadratically many).
    budget: u64,
    /// Offset of the opcode being run.
    op: u64,
}

impl Vm<'_> {
    fn err(&self, detail: impl Into<String>) -> FileError {
        FileError::Pickle {
            path: self.ctx.p(),
            offset: self.op,
            detail: detail.into(),
        }
    }

    fn alloc(&mut self, o: Object) -> Result<Value, FileError> {
        let id = ObjId::try_from(self.objects.len()).map_err(|_| self.err("too many objects"))?;
        self.objects.push(o);
        Ok(Value::Obj(id))
    }

    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<Value, FileError> {
        if self.stack.len() <= self.floor() {
            return Err(self.err("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }

    fn top(&self) -> Result<&Value, FileError> {
        if self.stack.len() <= self.floor() {
            return Err(self.err("stack underflow"));
        }
        self.stack.last().ok_or_else(|| self.err("stack underflow"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>, FileError> {
        let m = self
            .marks
            .pop()
            .ok_or_else(|| self.err("no MARK on the stack"))?;
        if m > self.stack.len() {
            return Err(self.err("MARK above the stack"));
        }
        Ok(self.stack.split_off(m))
    }

    fn line(&self, cur: &mut Cursor) -> Result<Vec<u8>, FileError> {
        let mut out = Vec::new();
        loop {
            let b = cur.u8()?;
            if b == b'\n' {
                return Ok(out);
            }
            if out.len() >= MAX_LINE {
                return Err(self.err("text argument too long"));
            }
            out.push(b);
        }
    }

    fn text_line(&self, cur: &mut Cursor) -> Result<String, FileError> {
        let l = self.line(cur)?;
        String::from_utf8(l).map_err(|_| self.err("text argument is not UTF-8"))
    }

    fn str_of(&self, bytes: Vec<u8>) -> Result<Value, FileError> {
        let s = String::from_utf8(bytes).map_err(|_| self.err("string is not valid UTF-8"))?;
        Ok(Value::Str(s.into()))
    }

    fn len_prefixed(&self, cur: &mut Cursor, n: u64) -> Result<Vec<u8>, FileError> {
        cur.read_vec(n)
    }

    fn set_memo(&mut self, idx: u32) -> Result<(), FileError> {
        let v = self.top()?.clone();
        self.memo.insert(idx, v);
        Ok(())
    }

    fn get_memo(&mut self, idx: u32) -> Result<(), FileError> {
        let v = self
            .memo
            .get(&idx)
            .cloned()
            .ok_or_else(|| self.err(format!("memo entry {idx} is missing")))?;
        self.stack.push(v);
        Ok(())
    }

    fn push_tuple(&mut self, items: Vec<Value>) -> Result<(), FileError> {
        let v = self.alloc(Object::Tuple(items))?;
        self.stack.push(v);
        Ok(())
    }

    fn run(&mut self, cur: &mut Cursor) -> Result<Value, FileError> {
        loop {
            self.op = cur.pos();
            let op = cur.u8()?;
            match op {
                // PROTO
                0x80 => {
                    let v = cur.u8()?;
                    if v > 5 {
                        return Err(self.err(format!("unsupported pickle protocol {v}")));
                    }
                }
                // FRAME: a length hint only.
                0x95 => {
                    cur.u64()?;
                }
                // STOP
                b'.' => return self.pop(),
                // MARK
                b'(' => self.marks.push(self.stack.len()),
                // POP
                b'0' => {
                    if self.stack.len() > self.floor() {
                        self.pop()?;
                    } else {
                        self.pop_mark()?;
                    }
                }
                // POP_MARK
                b'1' => {
                    self.pop_mark()?;
                }
                // DUP
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                // NONE, NEWTRUE, NEWFALSE
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                // INT (text): I01 / I00 are booleans.
                b'I' => {
                    let l = self.text_line(cur)?;
                    let v = match l.as_str() {
                        "01" => Value::Bool(true),
                        "00" => Value::Bool(false),
                        s => Value::Int(s.parse().map_err(|_| self.err(format!("bad INT {s:?}")))?),
                    };
                    self.stack.push(v);
                }
                // LONG (text)
                b'L' => {
                    let l = self.text_line(cur)?;
                    let s = l.strip_suffix('L').unwrap_or(&l);
                    let v = s.parse().map_err(|_| self.err(format!("bad LONG {s:?}")))?;
                    self.stack.push(Value::Int(v));
                }
                // FLOAT (text)
                b'F' => {
                    let l = self.text_line(cur)?;
                    let v = l
                        .trim()
                        .parse()
                        .map_err(|_| self.err(format!("bad FLOAT {l:?}")))?;
                    self.stack.push(Value::Float(v));
                }
                // BININT, BININT1, BININT2
                b'J' => {
                    let v = cur.u32()? as i32;
                    self.stack.push(Value::Int(v.into()));
                }
                b'K' => {
                    let v = cur.u8()?;
                    self.stack.push(Value::Int(v.into()));
                }
                b'M' => {
                    let v = cur.u16()?;
                    self.stack.push(Value::Int(v.into()));
                }
                // LONG1, LONG4
                0x8a => {
                    let n = cur.u8()?;
                    let b = cur.read_vec(n.into())?;
                    let v = self.long(&b)?;
                    self.stack.push(v);
                }
                0x8b => {
                    let n = cur.u32()? as i32;
                    if n < 0 {
                        return Err(self.err("negative LONG4 length"));
                    }
                    let b = cur.read_vec(n as u64)?;
                    let v = self.long(&b)?;
                    self.stack.push(v);
                }
                // BINFLOAT (big endian)
                b'G' => {
                    let b = cur.array::<8>()?;
                    self.stack.push(Value::Float(f64::from_be_bytes(b)));
                }
                // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8
                b'X' => {
                    let n = cur.u32()?;
                    let b = self.len_prefixed(cur, n.into())?;
                    let v = self.str_of(b)?;
                    self.stack.push(v);
                }
                0x8c => {
                    let n = cur.u8()?;
                    let b = self.len_prefixed(cur, n.into())?;
                    let v = self.str_of(b)?;
                    self.stack.push(v);
                }
                0x8d => {
                    let n = cur.u64()?;
                    let b = self.len_prefixed(cur, n)?;
                    let v = self.str_of(b)?;
                    self.stack.push(v);
                }
                // BINSTRING, SHORT_BINSTRING (Python 2 str): decoded as Latin-1.
                b'T' => {
                    let n = cur.u32()? as i32;
                    if n < 0 {
                        return Err(self.err("negative BINSTRING length"));
                    }
                    let b = self.len_prefixed(cur, n as u64)?;
                    self.stack.push(Value::Str(
                        b.iter().map(|&c| c as char).collect::<String>().into(),
                    ));
                }
                b'U' => {
                    let n = cur.u8()?;
                    let b = self.len_prefixed(cur, n.into())?;
                    self.stack.push(Value::Str(
                        b.iter().map(|&c| c as char).collect::<String>().into(),
                    ));
                }
                // BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                b'B' => {
                    let n = cur.u32()?;
                    let b = self.len_prefixed(cur, n.into())?;
                    self.stack.push(Value::Bytes(b.into()));
                }
                b'C' => {
                    let n = cur.u8()?;
                    let b = self.len_prefixed(cur, n.into())?;
                    self.stack.push(Value::Bytes(b.into()));
                }
                0x8e | 0x96 => {
                    let n = cur.u64()?;
                    let b = self.len_prefixed(cur, n)?;
                    self.stack.push(Value::Bytes(b.into()));
                }
                // EMPTY_TUPLE, TUPLE, TUPLE1..3
                b')' => self.push_tuple(Vec::new())?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push_tuple(items)?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push_tuple(items)?;
                }
                // EMPTY_LIST, LIST, EMPTY_SET, FROZENSET
                b']' | 0x8f => {
                    let v = self.alloc(Object::List(Vec::new()))?;
                    self.stack.push(v);
                }
                b'l' | 0x91 => {
                    let items = self.pop_mark()?;
                    let v = self.alloc(Object::List(items))?;
                    self.stack.push(v);
                }
                // APPEND
                b'a' => {
                    let v = self.pop()?;
                    self.extend_list(vec![v])?;
                }
                // APPENDS, ADDITEMS
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                // EMPTY_DICT, DICT
                b'}' => {
                    let v = self.alloc(Object::Dict(Vec::new()))?;
                    self.stack.push(v);
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    let v = self.alloc(Object::Dict(pairs))?;
                    self.stack.push(v);
                }
                // SETITEM, SETITEMS
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend_dict(vec![(k, v)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    self.extend_dict(pairs)?;
                }
                // PUT, BINPUT, LONG_BINPUT, MEMOIZE
                b'p' => {
                    let l = self.text_line(cur)?;
                    let idx = l
                        .parse()
                        .map_err(|_| self.err(format!("bad PUT index {l:?}")))?;
                    self.set_memo(idx)?;
                }
                b'q' => {
                    let idx = cur.u8()?;
                    self.set_memo(idx.into())?;
                }
                b'r' => {
                    let idx = cur.u32()?;
                    self.set_memo(idx)?;
                }
                0x94 => {
                    let idx =
                        u32::try_from(self.memo.len()).map_err(|_| self.err("memo too large"))?;
                    self.set_memo(idx)?;
                }
                // GET, BINGET, LONG_BINGET
                b'g' => {
                    let l = self.text_line(cur)?;
                    let idx = l
                        .parse()
                        .map_err(|_| self.err(format!("bad GET index {l:?}")))?;
                    self.get_memo(idx)?;
                }
                b'h' => {
                    let idx = cur.u8()?;
                    self.get_memo(idx.into())?;
                }
                b'j' => {
                    let idx = cur.u32()?;
                    self.get_memo(idx)?;
                }
                // GLOBAL, STACK_GLOBAL
                b'c' => {
                    let module = self.text_line(cur)?;
                    let name = self.text_line(cur)?;
                    let g = self.resolve(&module, &name)?;
                    self.stack.push(Value::Global(g));
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) = (module, name) else {
                        return Err(self.err("STACK_GLOBAL needs two strings"));
                    };
                    let g = self.resolve(&module, &name)?;
                    self.stack.push(Value::Global(g));
                }
                // INST: class from text lines, arguments since MARK.
                b'i' => {
                    let module = self.text_line(cur)?;
                    let name = self.text_line(cur)?;
                    let g = self.resolve(&module, &name)?;
                    let args = self.pop_mark()?;
                    let v = self.new_object(&g, args)?;
                    self.stack.push(v);
                }
                // OBJ: class and arguments since MARK.
                b'o' => {
                    let mut items = self.pop_mark()?;
                    if items.is_empty() {
                        return Err(self.err("OBJ without a class"));
                    }
                    let cls = items.remove(0);
                    let Value::Global(g) = cls else {
                        return Err(self.err("OBJ class is not a global"));
                    };
                    let v = self.new_object(&g, items)?;
                    self.stack.push(v);
                }
                // REDUCE
                b'R' => {
                    let args = self.pop()?;
                    let f = self.pop()?;
                    let args = self.tuple_items(&args, "REDUCE arguments")?;
                    let Value::Global(g) = f else {
                        return Err(self.err("REDUCE of a value that is not a global"));
                    };
                    let v = self.call(&g, args, 0)?;
                    self.stack.push(v);
                }
                // NEWOBJ, NEWOBJ_EX
                0x81 => {
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.tuple_items(&args, "NEWOBJ arguments")?;
                    let Value::Global(g) = cls else {
                        return Err(self.err("NEWOBJ of a value that is not a global"));
                    };
                    let v = self.new_object(&g, args)?;
                    self.stack.push(v);
                }
                0x92 => {
                    let _kwargs = self.pop()?;
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let args = self.tuple_items(&args, "NEWOBJ_EX arguments")?;
                    let Value::Global(g) = cls else {
                        return Err(self.err("NEWOBJ_EX of a value that is not a global"));
                    };
                    let v = self.new_object(&g, args)?;
                    self.stack.push(v);
                }
                // BUILD: object state (attributes) is dropped; nothing runs.
                b'b' => {
                    self.pop()?;
                    self.top()?;
                }
                // BINPERSID
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_load(&pid)?;
                    self.stack.push(v);
                }
                b'P' => return Err(self.err("text persistent ids (PERSID) are not supported")),
                0x82..=0x84 => return Err(self.err("extension registry opcodes are not supported")),
                0x97 | 0x98 => return Err(self.err("out-of-band buffers are not supported")),
                b'S' | b'V' => return Err(self.err("text string opcodes are not supported")),
                other => return Err(self.err(format!("unknown opcode 0x{other:02x}"))),
            }
        }
    }

    fn long(&self, b: &[u8]) -> Result<Value, FileError> {
        if b.is_empty() {
            return Ok(Value::Int(0));
        }
        let negative = b[b.len() - 1] & 0x80 != 0;
        let fill = if negative { 0xff } else { 0 };
        if b.len() > 16 && b[16..].iter().any(|&x| x != fill) {
            return Err(self.err("integer wider than 128 bits"));
        }
        let mut buf = [fill; 16];
        let n = b.len().min(16);
        buf[..n].copy_from_slice(&b[..n]);
        let v = i128::from_le_bytes(buf);
        if b.len() > 16 && (v < 0) != negative {
            return Err(self.err("integer wider than 128 bits"));
        }
        Ok(Value::Int(v))
    }

    fn pairs(&self, items: Vec<Value>) -> Result<Vec<(Value, Value)>, FileError> {
        if items.len() & 1 != 0 {
            return Err(self.err("odd number of items for a dict"));
        }
        let mut out = Vec::with_capacity(items.len() / 2);
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            out.push((k, v));
        }
        Ok(out)
    }

    fn target(&self) -> Result<usize, FileError> {
        match self.top()? {
            Value::Obj(id) => Ok(*id as usize),
            _ => Err(self.err("container operation on a value that is not a container")),
        }
    }

    fn extend_list(&mut self, items: Vec<Value>) -> Result<(), FileError> {
        let id = self.target()?;
        match self.objects.get_mut(id) {
            Some(Object::List(l)) => {
                l.extend(items);
                Ok(())
            }
            Some(Object::Inert { .. }) => Ok(()),
            _ => Err(self.err("APPEND to something that is not a list")),
        }
    }

    fn extend_dict(&mut self, pairs: Vec<(Value, Value)>) -> Result<(), FileError> {
        let id = self.target()?;
        match self.objects.get_mut(id) {
            Some(Object::Dict(d)) => {
                d.extend(pairs);
                Ok(())
            }
            Some(Object::Inert { .. }) => Ok(()),
            _ => Err(self.err("SETITEM on something that is not a dict")),
        }
    }

    fn spend(&mut self, n: usize) -> Result<(), FileError> {
        match self.budget.checked_sub(n as u64) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(self.err("pickle copies too many values (memo amplification)")),
        }
    }

    fn tuple_items(&mut self, v: &Value, what: &str) -> Result<Vec<Value>, FileError> {
        let len = match self.deref(v) {
            Some(Object::Tuple(t)) => t.len(),
            _ => return Err(self.err(format!("{what} are not a tuple"))),
        };
        self.spend(len)?;
        match v {
            Value::Obj(id) => match self.objects.get(*id as usize) {
                Some(Object::Tuple(t)) => Ok(t.clone()),
                _ => Err(self.err(format!("{what} are not a tuple"))),
            },
            _ => Err(self.err(format!("{what} are not a tuple"))),
        }
    }

    fn resolve(&self, module: &str, name: &str) -> Result<Global, FileError> {
        use Global as G;
        let known = match (module, name) {
            ("collections", "OrderedDict") => Some(G::OrderedDict),
            ("torch._utils", "_rebuild_tensor_v2") => Some(G::RebuildTensorV2),
            ("torch._utils", "_rebuild_tensor") => Some(G::RebuildTensor),
            ("torch._utils", "_rebuild_parameter") => Some(G::RebuildParameter),
            ("torch._utils", "_rebuild_parameter_with_state") => Some(G::RebuildParameterWithState),
            ("torch._tensor", "_rebuild_from_type_v2") => Some(G::RebuildFromTypeV2),
            ("torch", "Size") => Some(G::TorchSize),
            ("torch", "Tensor")
            | ("torch._tensor", "Tensor")
            | ("torch.nn.parameter", "Parameter") => Some(G::TensorClass),
            ("torch.storage", "UntypedStorage") => storage_kind("UntypedStorage").map(G::Storage),
            ("torch", n) => storage_kind(n)
                .map(G::Storage)
                .or_else(|| dtype_kind(n).map(G::Dtype)),
            ("_codecs", "encode") => Some(G::CodecsEncode),
            _ => None,
        };
        if let Some(g) = known {
            return Ok(g);
        }
        let dangerous = DANGEROUS_MODULES.iter().any(|d| {
            module == *d
                || module
                    .strip_prefix(d)
                    .is_some_and(|rest| rest.starts_with('.'))
        });
        if self.opts.globals == GlobalPolicy::Inert && !dangerous {
            return Ok(G::Inert {
                module: module.into(),
                name: name.into(),
            });
        }
        Err(FileError::ForbiddenGlobal {
            path: self.ctx.p(),
            module: module.to_string(),
            name: name.to_string(),
        })
    }

    fn uint(&self, v: &Value, what: &str) -> Result<u64, FileError> {
        match v {
            Value::Int(i) => {
                u64::try_from(*i).map_err(|_| self.err(format!("{what} {i} is out of range")))
            }
            Value::Bool(b) => Ok(u64::from(*b)),
            _ => Err(self.err(format!("{what} is not an integer"))),
        }
    }

    fn uints(&self, v: &Value, what: &str) -> Result<Vec<u64>, FileError> {
        let items = match v {
            Value::Obj(id) => match self.objects.get(*id as usize) {
                Some(Object::Tuple(t)) | Some(Object::List(t)) => t,
                _ => return Err(self.err(format!("{what} is not a tuple"))),
            },
            _ => return Err(self.err(format!("{what} is not a tuple"))),
        };
        items.iter().map(|x| self.uint(x, what)).collect()
    }

    /// `cls.__new__(cls, *args)` for allowlisted classes.
    fn new_object(&mut self, g: &Global, _args: Vec<Value>) -> Result<Value, FileError> {
        match g {
            Global::OrderedDict => self.alloc(Object::Dict(Vec::new())),
            Global::Inert { module, name } => {
                let (module, name) = (module.clone(), name.clone());
                self.alloc(Object::Inert { module, name })
            }
            other => Err(self.err(format!("cannot instantiate {other:?}"))),
        }
    }

    /// `f(*args)` for allowlisted callables: builds plain values, runs nothing.
    fn call(&mut self, g: &Global, args: Vec<Value>, depth: u32) -> Result<Value, FileError> {
        match g {
            Global::OrderedDict => match args.as_slice() {
                [] => self.alloc(Object::Dict(Vec::new())),
                [items] => {
                    let n = match self.deref(items) {
                        Some(Object::List(l)) | Some(Object::Tuple(l)) => l.len(),
                        _ => return Err(self.err("OrderedDict argument is not a list")),
                    };
                    self.spend(n.saturating_mul(3))?;
                    let list = match self.deref(items) {
                        Some(Object::List(l)) | Some(Object::Tuple(l)) => l.clone(),
                        _ => Vec::new(),
                    };
                    let mut pairs = Vec::with_capacity(list.len());
                    for item in &list {
                        match self.deref(item) {
                            Some(Object::Tuple(p)) | Some(Object::List(p)) if p.len() == 2 => {
                                pairs.push((p[0].clone(), p[1].clone()))
                            }
                            _ => return Err(self.err("OrderedDict item is not a pair")),
                        }
                    }
                    self.alloc(Object::Dict(pairs))
                }
                _ => Err(self.err("OrderedDict takes at most one argument")),
            },
            Global::RebuildTensorV2 | Global::RebuildTensor => {
                if args.len() < 4 {
                    return Err(self.err("_rebuild_tensor needs (storage, offset, size, stride)"));
                }
                let storage = match &args[0] {
                    Value::Obj(id)
                        if matches!(self.objects.get(*id as usize), Some(Object::Storage(_))) =>
                    {
                        *id
                    }
                    _ => return Err(self.err("_rebuild_tensor: first argument is not a storage")),
                };
                let offset = self.uint(&args[1], "storage offset")?;
                let shape = self.uints(&args[2], "tensor size")?;
                let stride = self.uints(&args[3], "tensor stride")?;
                self.alloc(Object::Tensor(TensorRef {
                    storage,
                    offset,
                    shape,
                    stride,
                }))
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => args
                .into_iter()
                .next()
                .ok_or_else(|| self.err("_rebuild_parameter without data")),
            Global::RebuildFromTypeV2 => {
                if depth >= MAX_CALL_DEPTH {
                    return Err(self.err("_rebuild_from_type_v2 nested too deeply"));
                }
                if args.len() < 3 {
                    return Err(self.err("_rebuild_from_type_v2 needs (func, type, args, state)"));
                }
                let Value::Global(f) = &args[0] else {
                    return Err(self.err("_rebuild_from_type_v2: func is not a global"));
                };
                let inner = self.tuple_items(&args[2], "_rebuild_from_type_v2 arguments")?;
                let f = f.clone();
                self.call(&f, inner, depth + 1)
            }
            Global::TorchSize => match args.as_slice() {
                [v] => Ok(v.clone()),
                _ => Err(self.err("torch.Size takes one argument")),
            },
            Global::CodecsEncode => {
                let (s, enc) = match args.as_slice() {
                    [Value::Str(s)] => (s.clone(), "utf-8".into()),
                    [Value::Str(s), Value::Str(e)] => (s.clone(), e.to_ascii_lowercase()),
                    _ => return Err(self.err("_codecs.encode needs (str, encoding)")),
                };
                let bytes: Vec<u8> = match enc.as_str() {
                    "latin1" | "latin-1" | "iso-8859-1" | "ascii" => s
                        .chars()
                        .map(|c| {
                            u8::try_from(u32::from(c))
                                .map_err(|_| self.err("character outside Latin-1"))
                        })
                        .collect::<Result<_, _>>()?,
                    "utf-8" | "utf8" => s.as_bytes().to_vec(),
                    other => {
                        return Err(
                            self.err(format!("_codecs.encode: unsupported encoding {other:?}"))
                        )
                    }
                };
                Ok(Value::Bytes(bytes.into()))
            }
            Global::Inert { module, name } => {
                let (module, name) = (module.clone(), name.clone());
                self.alloc(Object::Inert { module, name })
            }
            other => Err(self.err(format!("{other:?} is not callable here"))),
        }
    }

    fn deref(&self, v: &Value) -> Option<&Object> {
        match v {
            Value::Obj(id) => self.objects.get(*id as usize),
            _ => None,
        }
    }

    /// `('storage', storage_type, key, location, numel[, view_metadata])`
    fn persistent_load(&mut self, pid: &Value) -> Result<Value, FileError> {
        if !self.opts.persistent {
            return Err(self.err("persistent id outside the main pickle"));
        }
        let items = self.tuple_items(pid, "persistent id fields")?;
        let (tag, ty, key, location, numel) = match items.as_slice() {
            [tag, ty, key, loc, numel] | [tag, ty, key, loc, numel, _] => {
                (tag, ty, key, loc, numel)
            }
            _ => return Err(self.err(format!("persistent id with {} fields", items.len()))),
        };
        if !matches!(tag, Value::Str(s) if &**s == "storage") {
            return Err(self.err("persistent id is not a storage"));
        }
        let kind = match ty {
            Value::Global(Global::Storage(k)) => *k,
            _ => return Err(self.err("persistent id: storage type is not a torch storage class")),
        };
        let key = match key {
            Value::Str(s) => s.to_string(),
            Value::Int(i) => i.to_string(),
            _ => return Err(self.err("persistent id: storage key is not a string")),
        };
        let location = match location {
            Value::Str(s) => s.to_string(),
            _ => String::new(),
        };
        let numel = self.uint(numel, "storage size")?;
        let view = match items.get(5) {
            None | Some(Value::None) => None,
            Some(v) => {
                let vm = self.tuple_items(v, "storage view")?;
                match vm.as_slice() {
                    [_, off, size] => Some((
                        self.uint(off, "view offset")?,
                        self.uint(size, "view size")?,
                    )),
                    _ => return Err(self.err("storage view is not (key, offset, size)")),
                }
            }
        };
        self.alloc(Object::Storage(StorageRef {
            key,
            kind,
            location,
            numel,
            view,
        }))
    }
}

fn storage_kind(name: &str) -> Option<StorageKind> {
    STORAGES.iter().find(|s| s.0 == name).map(|s| StorageKind {
        name: s.0,
        dtype: s.2,
        elsize: s.3,
    })
}

fn dtype_kind(name: &str) -> Option<StorageKind> {
    let name = DTYPE_ALIASES
        .iter()
        .find(|a| a.0 == name)
        .map_or(name, |a| a.1);
    STORAGES.iter().find(|s| s.1 == name).map(|s| StorageKind {
        name: s.1,
        dtype: s.2,
        elsize: s.3,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn run_bytes(b: &[u8], globals: GlobalPolicy) -> Result<Pickled, FileError> {
        let ctx = Ctx::new(Path::new("test.pkl"));
        let b = &b;
        let mut cur = Cursor::new(b, ctx, 0, b.len() as u64);
        run(
            &mut cur,
            ctx,
            PickleOptions {
                globals,
                persistent: true,
            },
        )
    }

    #[test]
    fn builds_a_dict() {
        // {'a': 1, 'b': [2, 3]} at protocol 2
        let p = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01K\x01X\x01\x00\x00\x00bq\x02]q\x03(K\x02K\x03eu.";
        let r = run_bytes(p, GlobalPolicy::Strict).unwrap();
        let Some(Object::Dict(d)) = r.deref(r.root.as_ref().unwrap()) else {
            panic!()
        };
        assert_eq!(d.len(), 2);
        assert_eq!(d[0], (Value::Str("a".into()), Value::Int(1)));
        assert!(matches!(r.deref(&d[1].1), Some(Object::List(l)) if l.len() == 2));
    }

    #[test]
    fn forbidden_globals_are_named() {
        let p = b"\x80\x02cos\nsystem\nq\x00X\x02\x00\x00\x00lsq\x01\x85q\x02Rq\x03.";
        for policy in [GlobalPolicy::Strict, GlobalPolicy::Inert] {
            let e = run_bytes(p, policy).unwrap_err();
            assert!(
                matches!(&e, FileError::ForbiddenGlobal { module, name, .. } if module == "os" && name == "system")
            );
        }
        let p = b"\x80\x04\x8c\x09numpy.fooq\x00\x8c\x03barq\x01\x93q\x02)Rq\x03.";
        assert!(matches!(
            run_bytes(p, GlobalPolicy::Strict),
            Err(FileError::ForbiddenGlobal { .. })
        ));
        let r = run_bytes(p, GlobalPolicy::Inert).unwrap();
        assert!(matches!(
            r.deref(r.root.as_ref().unwrap()),
            Some(Object::Inert { .. })
        ));
    }

    #[test]
    fn long_integers() {
        let r = run_bytes(
            b"\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.",
            GlobalPolicy::Strict,
        )
        .unwrap();
        assert_eq!(r.root, Some(Value::Int(0x1950a86a20f9469cfc6c)));
        let r = run_bytes(b"\x8a\x01\xff.", GlobalPolicy::Strict).unwrap();
        assert_eq!(r.root, Some(Value::Int(-1)));
        assert!(run_bytes(
            b"\x8a\x11\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01.",
            GlobalPolicy::Strict
        )
        .is_err());
    }

    #[test]
    fn marks_fence_the_stack() {
        assert!(run_bytes(b"K\x01(.", GlobalPolicy::Strict).is_err());
        assert_eq!(
            run_bytes(b"K\x01(0.", GlobalPolicy::Strict).unwrap().root,
            Some(Value::Int(1))
        );
        assert!(run_bytes(b"(s.", GlobalPolicy::Strict).is_err());
        assert!(run_bytes(b"h\x00.", GlobalPolicy::Strict).is_err());
    }
}
