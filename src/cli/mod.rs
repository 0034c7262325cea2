pub(crate) mod size;
