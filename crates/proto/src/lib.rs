//! What both sides of a run speak, below the launcher and the node agent (neither can reach
//! the other's modules): [`protocol`] (the messages and store keys between the launch host,
//! agents and ranks), [`facts`] (what a node reports about itself, compared), [`remote`] (ssh
//! and srun command lines, pure).

pub mod facts;
pub mod protocol;
pub mod remote;
