//! The main job: P/D replay of a real trace (`kvferry pd`).

pub mod pd;
pub mod trace;
