//! Model file readers and the catalog (being written).
