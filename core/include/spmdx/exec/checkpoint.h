// Checkpoints: each rank writes its shards, rank 0 one metadata file (global shapes, dtypes,
// placements, mesh, step, data-set position), into <folder>/step-<N>/. Written atomically:
// everything goes into a temporary folder, files are fsync'ed, and rank 0 renames the folder
// into place only after every rank has finished, so a crash mid-save never leaves a
// checkpoint that looks whole. Loading on the same mesh reads the rank's own file; on another
// mesh or strategy each rank reassembles the full tensors from every file and takes its new
// shards (resharding, as torch.distributed.checkpoint does).
//
// Shard file format: 8 bytes "SPMDXCK1", u64 header length, a JSON header {tensors: [{name,
// dtype, shape, global_offset, offset, bytes, crc32}]}, then the raw little-endian data.
// metadata.json (version 2): format, version, step, data_samples, [optimizer_steps],
// [grad_scaler {scale, growth_tracker}], [lr_schedule {steps, warmup_steps, decay_ratio,
// decay_type, min_lr_factor}], world_size, mesh [{name,
// size}], tensors {name: {shape, dtype, placements}}, files {rank<R>.bin: {bytes,
// header_crc32}}, and crc32, the CRC-32 of the compact JSON of everything else. Version 1
// (no files, no crc32) is still read. Version 3 (written only with pipeline stages): also
// pipeline {stages}, each tensor's stage, mesh one stage's and world_size stages x its size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <set>
#include <optional>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/exec/executor.h"
#include "spmdx/models/weights.h"
#include "spmdx/sharding/rewriter.h"
#include "spmdx/train/train_step.h"

namespace spmdx::exec {

struct CheckpointMeta {
  std::int64_t step = 0;
  std::uint64_t data_samples = 0;  ///< TextDatasetState::samples
  /// What the token ids mean: "byte", or the tokenizer file's hash and size ("" when the
  /// checkpoint does not say: version 1, or older version 2).
  std::string tokenizer;
  /// The updates AdamW has applied by `step` (fewer when float16 skipped some; its bias
  /// correction counts them); -1: as many as steps (metadata.json's optional "optimizer_steps").
  std::int64_t optimizer_steps = -1;
  /// float16 loss scaling (train::GradScaler): the scale and its growth count after `step`;
  /// loss_scale 0: none (metadata.json's optional "grad_scaler" {scale, growth_tracker}).
  double loss_scale = 0;
  std::int64_t growth_tracker = 0;
  /// The learning-rate schedule the steps up to `step` followed (metadata.json's optional
  /// "lr_schedule" {steps, warmup_steps, decay_ratio, decay_type, min_lr_factor}); nullopt in
  /// checkpoints written before it was recorded.
  std::optional<train::LrSchedule> lr_schedule{};
};

/// Pipeline stages in a checkpoint (metadata.json version 3): `stages` groups of mesh.size()
/// ranks, rank R holding stage R / mesh.size()'s tensors at place R % mesh.size() of `mesh`
/// (train/pipeline.h); `stage` names each tensor's stage (a buffer read by several: the first).
struct PipelineStages {
  std::int64_t stages = 1;
  std::map<std::string, int> stage;
};
/// Who writes what of a save besides the rank's own shard: the metadata (rank 0, or under
/// fault tolerance the lowest live rank, which also makes the folder), and the shard files of
/// ranks that are away (fault tolerance: a replica group lost holds what the live groups hold,
/// so a live rank of the same coordinates writes its file). Null: rank 0 writes the metadata.
struct SaveRoles {
  bool writes_metadata = false;
  std::vector<std::int64_t> also_ranks;
};
/// Writes this rank's `local` tensors (by name; their global metas and placements in `global`
/// and `placements`, every stage's with pipeline stages) for `step`. Every rank calls it; `backend` (null for one rank) makes them
/// wait for each other before rank 0 publishes the checkpoint. Returns the folder. Throws
/// std::runtime_error naming the file that could not be written, or, before anything is
/// written, the tensor of `local` that holds NaN or infinite values (one isfinite().all() per
/// floating tensor): a diverged state is never saved, and the earlier checkpoints stay; or, before
/// anything is written, that a complete checkpoint of `meta.step` is already in `folder` (an
/// earlier run's): it is never replaced (a step folder that is not complete is).
std::filesystem::path save_checkpoint(const std::filesystem::path& folder, const CheckpointMeta& meta, const sharding::DeviceMesh& mesh,
                                      std::int64_t rank, const TensorMap& local, const std::map<std::string, ir::TensorMeta>& global,
                                      const std::map<std::string, sharding::Placements>& placements, CommBackend* backend,
                                      const PipelineStages& pipeline = {}, const SaveRoles* roles = nullptr);

/// The step of the newest complete checkpoint in `folder` (load_step -1), or load_step itself
/// when it is complete; nullopt when the folder holds no step folder. Only the names spmdx
/// writes count (train::checkpoint_step); with `warn`, others are said to be ignored, and
/// incomplete step folders newer than the one chosen are named. Throws std::runtime_error
/// (train::resume_problem's text) when load_step >= 0 names no complete checkpoint, or when step
/// folders are there but none is complete.
std::optional<std::int64_t> find_checkpoint(const std::filesystem::path& folder, std::int64_t load_step, bool warn = true);

/// checkpoint.keep_latest_k, after checkpoint `saved` is complete (call it on rank 0 only): deletes
/// the oldest complete checkpoints of `folder` beyond the newest `keep` (by step, as torchtitan's
/// _purge_stale_checkpoints), never `saved` itself, nor a folder spmdx did not write (a name
/// it does not write, a link, or a metadata.json that does not read as a spmdx checkpoint of
/// its step). Each is renamed to .step-<N>.deleting first, so a crash mid-delete leaves no
/// step folder that looks like a damaged checkpoint. keep 0: nothing. Returns what was deleted.
/// Throws std::runtime_error naming a folder that cannot be deleted.
std::vector<std::filesystem::path> purge_checkpoints(const std::filesystem::path& folder, std::int64_t keep, std::int64_t saved);

/// The step and data position of checkpoint `step`, its metadata.json checked (see
/// load_checkpoint). Throws std::runtime_error naming the file and the key.
CheckpointMeta read_checkpoint_meta(const std::filesystem::path& folder, std::int64_t step);

/// This rank's tensors from checkpoint `step`, for a run on `mesh` with `placements` (every
/// name in `global` must be in the checkpoint with the same global shape and dtype). With
/// pipeline stages (in the run, `pipeline`, or in the checkpoint) `rank` is global, `mesh` one
/// stage's and `global` this rank's stage's tensors; each is reassembled from the files of the
/// stage that saved it. Throws
/// std::runtime_error naming the file (and the key) for: a tensor this rank loads that holds NaN
/// or infinite values (its name, file and checkpoint, and what to do); a metadata.json that fails its own
/// CRC-32, has a version this build does not read (1, 2), or a field of the wrong type or out of
/// range (a step that is not its folder's, a data position outside [step, step x 1e7], a world
/// size that is not the mesh's or the number of shard files); a shard file that is truncated,
/// corrupted (CRC-32 of its header, recorded in metadata.json, and of every tensor), or holds
/// tensors whose shape, dtype or place in the global tensor disagrees with the placements
/// metadata.json gives; a missing tensor, or a shape that differs from this run's; a tensor
/// the checkpoint holds that is neither in `global` nor in `not_loaded` (the run's buffers,
/// made from the config): a model with fewer layers would drop it and its AdamW state.
TensorMap load_checkpoint(const std::filesystem::path& folder, std::int64_t step, const sharding::DeviceMesh& mesh, std::int64_t rank,
                          const std::map<std::string, ir::TensorMeta>& global,
                          const std::map<std::string, sharding::Placements>& placements, CheckpointMeta* meta,
                          const std::set<std::string>& not_loaded = {}, const PipelineStages& pipeline = {});

/// Writes `tensors` (whole, contiguous) as a safetensors file (Hugging Face's format: u64 header
/// length, a JSON header with dtype, shape and data_offsets per tensor and `metadata` as
/// __metadata__, then the data), atomically. Throws std::runtime_error naming the file.
void write_safetensors(const std::filesystem::path& out, const TensorMap& tensors, const std::map<std::string, std::string>& metadata = {});

/// Writes the parameters of checkpoint `step_dir` (a step-N folder), consolidated into whole
/// tensors, as a safetensors file (Hugging Face's format: u64 header length, JSON header with
/// dtype, shape and data_offsets per tensor, then the data). Optimizer state is left out, as
/// torchtitan's last_save_model_only. `hf_names`: the built-in llama's parameters under Hugging
/// Face's names, query and key rows permuted to its half-split rotary layout
/// (to_hf_rotary_rows), the RoPE tables left out, as torchtitan's Llama3StateDictAdapter.to_hf;
/// the heads are read off the checkpoint's rope.cos table ([seq, head_dim / 2]). Returns the
/// number of tensors written. Throws std::runtime_error naming the file that is missing,
/// corrupted or cannot be written, and, with `hf_names`, a checkpoint that is not of the
/// built-in llama.
std::size_t export_safetensors(const std::filesystem::path& step_dir, const std::filesystem::path& out, bool hf_names = false);

/// A query or key projection's rows [heads x head_dim, dim] from the interleaved rotary layout
/// (torchtitan's and Meta's: pairs (2i, 2i+1) rotate together) to Hugging Face's half-split one
/// (i and i + head_dim / 2): w.view(heads, head_dim / 2, 2, dim).transpose(1, 2), as
/// transformers' convert_llama_weights_to_hf.py permute(). from_hf_rotary_rows undoes it.
/// Throws std::invalid_argument when the rows do not split into `heads` of even size.
at::Tensor to_hf_rotary_rows(const at::Tensor& w, std::int64_t heads);
at::Tensor from_hf_rotary_rows(const at::Tensor& w, std::int64_t heads);

/// The parameters `load` (models::plan_weight_load) names, whole, under the model's names, in
/// `dtype` (converted from the file's F32, BF16, F16 or F64), Hugging Face's query and key rows
/// put back in the interleaved layout. Throws std::runtime_error naming the file that cannot
/// be read.
TensorMap load_initial_weights(const models::WeightLoad& load, at::ScalarType dtype);

}  // namespace spmdx::exec
