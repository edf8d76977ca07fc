// TensorBoard event files: scalars that `tensorboard --logdir FOLDER` plots, written without
// LibTorch or TensorFlow (torchtitan's metrics.enable_tensorboard writes them through
// torch.utils.tensorboard.SummaryWriter; this is its add_scalar and flush).
//
// Format (TensorFlow's tensorflow/core/lib/io/record_writer.cc and
// tensorflow/core/util/events_writer.cc, which TensorBoard reads): a file of TFRecords,
//   uint64 length (little-endian) | uint32 masked_crc32c(length bytes) |
//   data[length]                  | uint32 masked_crc32c(data),
// each data an `Event` protocol buffer (tensorflow/core/util/event.proto); the first Event holds
// file_version "brain.Event:2", each later one a Summary with one scalar (simple_value).
// Protocol buffers come from Debian's protobuf (libprotobuf-lite), which stays out of this
// header: nothing that includes it needs protobuf.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace spmdx::metrics {

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, as iSCSI and TFRecord use) of `data`;
/// crc32c("123456789") == 0xE3069283.
std::uint32_t crc32c(std::string_view data);

/// TFRecord's masked CRC of `data`: ((c >> 15) | (c << 17)) + 0xa282ead8 with c = crc32c(data)
/// (tensorflow/core/lib/hash/crc32c.h, Mask), so that a CRC of data holding CRCs stays strong.
std::uint32_t masked_crc32c(std::string_view data);

/// `data` framed as one TFRecord: length, masked CRC of the length, data, masked CRC of the data.
std::string tfrecord(std::string_view data);

/// Seconds since the Unix epoch (the system clock, with its sub-second part): TensorBoard's
/// wall_time.
double unix_time_s();

/// One event file in a folder, as torch.utils.tensorboard.SummaryWriter(log_dir=folder) writes:
/// named events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n> (n counts the files this process
/// opened, from 0; a name that exists already takes the next n), its first record the
/// file_version event, written and flushed by the constructor.
///
/// Records are buffered in memory until flush() (or 1 MiB of them, or the destructor): call
/// flush() once a step's scalars are added, so that a run killed later keeps them. Not
/// thread-safe: one writer per process (rank 0's), used from one thread.
class EventWriter {
 public:
  /// Creates `folder` (and its parents) when missing and the event file in it. Throws
  /// std::runtime_error naming the folder or file when either cannot be created or written.
  explicit EventWriter(const std::filesystem::path& folder);
  /// Flushes what is buffered; an error there is logged (a warning), not thrown.
  ~EventWriter();
  EventWriter(EventWriter&&) noexcept;             ///< the moved-from writer is unusable
  EventWriter& operator=(EventWriter&&) noexcept;
  EventWriter(const EventWriter&) = delete;
  EventWriter& operator=(const EventWriter&) = delete;

  /// Buffers one scalar event (SummaryWriter.add_scalar): `value` under `tag` at training step
  /// `step`, stamped `wall_time_s` (seconds since the Unix epoch). TensorBoard keeps scalars as
  /// float32 (Summary.Value.simple_value): `value` is rounded to it, and one beyond float32's
  /// range becomes +-inf; NaN and inf are written as they are (TensorBoard shows them). Tags may
  /// hold '/' (TensorBoard groups "loss_metrics/global_avg_loss" under "loss_metrics"). Throws
  /// std::invalid_argument for an empty tag; std::runtime_error naming the file when a full
  /// buffer cannot be written.
  void add_scalar(const std::string& tag, double value, std::int64_t step, double wall_time_s = unix_time_s());

  /// Writes the buffered records to the file (to the operating system, which keeps them when the
  /// process dies; no fsync). Throws std::runtime_error naming the file on a write error; what
  /// was not written stays buffered for the next flush.
  void flush();

  /// The event file (folder / events.out.tfevents....).
  const std::filesystem::path& file() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spmdx::metrics
