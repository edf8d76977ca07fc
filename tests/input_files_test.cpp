// Files that are not what their reader expects, through every reader of a file a user gives or
// may edit. JSON nested too deep: nlohmann parses any depth, but copying, comparing or printing
// a value recurses once a level, and a file nesting 100,000 lists deep crashed `spmdx fr-trace`
// (SIGSEGV); each reader refuses it before parsing (check_json_nesting). A FIFO where a file
// should be: an std::ifstream on it blocks until a writer comes, and `spmdx fr-trace`, `diff`,
// `bench compare` and a run's tokenizer hung; each reader asks unreadable_file first.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <future>
#include <string>

#include "spmdx/bench/compare.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/exec/checkpoint.h"
#include "spmdx/files.h"
#include "spmdx/hooks/fr_trace.h"
#include "spmdx/ir/serialize.h"
#include "spmdx/models/weights.h"
#include "spmdx/plan/diff.h"
#include "spmdx/plan/estimate.h"
#include "spmdx/text.h"
#include "test_util.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

std::string nested(std::size_t depth) { return std::string(depth, '[') + std::string(depth, ']'); }
const std::string kDeep = nested(100'000);
const std::string kTooDeep = "JSON nested more than 256 arrays or objects deep";

std::string error_of(const std::function<void()>& read) {
  try {
    read();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(read)";
}

TEST(JsonNesting, TheLimitIsTwoHundredFiftySixLevels) {
  EXPECT_NO_THROW(check_json_nesting(nested(kMaxJsonNesting)));
  EXPECT_NO_THROW(check_json_nesting("{\"a\": " + nested(kMaxJsonNesting - 1) + "}"));
  try {
    check_json_nesting("{\"a\": " + nested(kMaxJsonNesting) + "}");
    FAIL() << "257 levels passed";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr(kTooDeep + " (at byte 261)"));  // the 257th opening bracket
  }
  // Brackets in strings, escaped quotes among them, are text; closing brackets restore depth.
  EXPECT_NO_THROW(check_json_nesting("[\"" + std::string(1000, '[') + "\\\"" + std::string(1000, '{') + "\"]"));
  EXPECT_NO_THROW(check_json_nesting(nested(200) + nested(200)));
  // Not JSON is the parser's to refuse.
  EXPECT_NO_THROW(check_json_nesting("not json ]]]"));
}

TEST(JsonNesting, EveryReaderOfAFileRefusesADeepOneNamingTheFile) {
  test::TempDir dir;
  // A graph (spmdx compile --dump, spmdx diff).
  EXPECT_THAT(error_of([&] { ir::from_json("{\"format\": \"spmdx.graph\", \"deep\": " + kDeep + "}", "logical.json"); }),
              HasSubstr("logical.json: not valid JSON: " + kTooDeep));
  // The calibration.
  EXPECT_THAT(error_of([&] { plan::Calibration::from_json("{\"deep\": " + kDeep + "}", "calibration.json"); }),
              HasSubstr("calibration.json: not JSON (" + kTooDeep));
  // A flight recorder dump (spmdx fr-trace).
  const fs::path fr = dir / "fr";
  fs::create_directories(fr);
  test::write_file(fr / "rank0.json",
                   "{\"format\": \"spmdx-flight-recorder-1\", \"rank\": 0, \"world_size\": 1, \"entries\": [{\"op\": \"all_reduce\", \"dtype\": \"f32\", "
                   "\"value\": \"%1\", \"state\": \"issued\", \"shape\": [1], \"bytes\": 4, \"step\": 1, \"seq\": 0, \"group_name\": \"dp\", "
                   "\"group_ranks\": [0, " + kDeep + "]}]}");  // the refusal of group_ranks printed it: SIGSEGV
  EXPECT_THAT(error_of([&] { hooks::analyze_flight_recorder(fr); }), HasSubstr((fr / "rank0.json").string() + ": not a valid flight recorder dump (" + kTooDeep));
  // A safetensors header (model.initial_load_path, spmdx export's output read back).
  std::string header = "{\"deep\": " + kDeep + "}";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<std::size_t>(i)] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  test::write_file(dir / "deep.safetensors", bytes + header);
  EXPECT_THAT(error_of([&] { models::read_safetensors_header(dir / "deep.safetensors"); }),
              AllOf(HasSubstr("deep.safetensors"), HasSubstr("its header is not JSON (not a safetensors file?): " + kTooDeep)));
  // A tokenizer.json.
  test::write_file(dir / "tokenizer.json", "{\"model\": " + kDeep + "}");
  EXPECT_THAT(error_of([&] { data::make_tokenizer((dir / "tokenizer.json").string()); }), AllOf(HasSubstr("tokenizer.json"), HasSubstr(kTooDeep)));
  // A JSON Lines data set: its line named.
  test::write_file(dir / "data.jsonl", "{\"text\": \"hello world, a document\"}\n{\"text\": " + kDeep + "}\n");
  data::TextDatasetOptions options;
  options.paths = {(dir / "data.jsonl").string()};
  options.batch_size = 1;
  options.seq_len = 4;
  data::ByteTokenizer bytes_tokenizer;
  EXPECT_THAT(error_of([&] { data::TextDataset(options, bytes_tokenizer); }), AllOf(HasSubstr("data.jsonl' line 2 is not valid JSON"), HasSubstr(kTooDeep)));
  // A run's metrics (spmdx bench compare).
  test::write_file(dir / "a.jsonl", "{\"step\": 1, \"deep\": " + kDeep + "}\n");
  EXPECT_THAT(error_of([&] { bench::compare_runs(dir / "a.jsonl", dir / "a.jsonl", {}); }), HasSubstr((dir / "a.jsonl").string() + ":1: not a JSON object (" + kTooDeep));
  // A compile dump (spmdx diff).
  const fs::path job = dir / "job";
  fs::create_directories(job);
  test::write_file(job / "logical.json", "{\"deep\": " + kDeep + "}");
  test::write_file(job / "plan.json", "{\"deep\": " + kDeep + "}");
  EXPECT_THAT(error_of([&] {
                const plan::JobDump d = plan::read_dump(job);
                plan::diff_jobs(d, d);
              }),
              HasSubstr(kTooDeep));
  // A checkpoint's metadata.json.
  fs::create_directories(dir / "ckpt" / "step-3");
  test::write_file(dir / "ckpt" / "step-3" / "metadata.json", "{\"step\": 3, \"deep\": " + kDeep + "}");
  EXPECT_THAT(error_of([&] { exec::read_checkpoint_meta(dir / "ckpt", 3); }),
              HasSubstr((dir / "ckpt" / "step-3" / "metadata.json").string() + ": corrupted (not JSON): " + kTooDeep));
}

// `read` against a FIFO at `fifo`. A reader that opens it blocks until a writer comes: after
// 10 s the test opens it for writing and closes it (the reader then sees an empty file), and fails.
std::string error_on_fifo(const fs::path& fifo, const std::function<void()>& read) {
  EXPECT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << fifo;
  auto reading = std::async(std::launch::async, [&] { return error_of(read); });
  if (reading.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << fifo << ": the reader blocked on the FIFO";
    const int fd = ::open(fifo.c_str(), O_WRONLY);
    if (fd >= 0) ::close(fd);
  }
  return reading.get();
}

TEST(Fifo, UnreadableFileNamesWhatIsThere) {
  test::TempDir dir;
  EXPECT_EQ(unreadable_file(dir / "none"), "no such file");
  EXPECT_EQ(unreadable_file(dir.path()), "not a regular file (a folder, FIFO or device)");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  EXPECT_EQ(unreadable_file(dir / "fifo"), "not a regular file (a folder, FIFO or device)");
  test::write_file(dir / "file", "x");
  EXPECT_EQ(unreadable_file(dir / "file"), "");
}

// read_file_bytes: the whole file, NUL bytes and all; what cannot be read is refused with
// unreadable_file's reason alone (the caller names the file), a FIFO without blocking.
TEST(Fifo, ReadFileBytesReadsAWholeFileAndRefusesTheRest) {
  test::TempDir dir;
  std::string bytes(70000, 'x');
  bytes[3] = '\0';
  bytes.back() = '\n';
  test::write_file(dir / "file", bytes);
  EXPECT_EQ(read_file_bytes(dir / "file"), bytes);
  test::write_file(dir / "empty", "");
  EXPECT_EQ(read_file_bytes(dir / "empty"), "");
  EXPECT_EQ(error_of([&] { read_file_bytes(dir / "none"); }), "no such file");
  EXPECT_EQ(error_of([&] { read_file_bytes(dir.path()); }), "not a regular file (a folder, FIFO or device)");
  EXPECT_EQ(error_on_fifo(dir / "fifo", [&] { read_file_bytes(dir / "fifo"); }), "not a regular file (a folder, FIFO or device)");
}

TEST(Fifo, EveryReaderOfAFileRefusesOneWithoutBlocking) {
  test::TempDir dir;
  const std::string fifo = "not a regular file (a folder, FIFO or device)";
  const fs::path fr = dir / "fr";
  fs::create_directories(fr);
  EXPECT_THAT(error_on_fifo(fr / "rank0.json", [&] { hooks::analyze_flight_recorder(fr); }),
              HasSubstr((fr / "rank0.json").string() + ": not a valid flight recorder dump (" + fifo));
  EXPECT_THAT(error_on_fifo(dir / "tokenizer.json", [&] { data::make_tokenizer((dir / "tokenizer.json").string()); }),
              AllOf(HasSubstr("tokenizer.json"), HasSubstr(fifo)));
  data::TextDatasetOptions options;
  options.paths = {(dir / "data.txt").string()};
  data::ByteTokenizer bytes_tokenizer;
  EXPECT_THAT(error_on_fifo(dir / "data.txt", [&] { data::TextDataset(options, bytes_tokenizer); }),
              HasSubstr("text data set: cannot read '" + (dir / "data.txt").string() + "': " + fifo));
  EXPECT_THAT(error_on_fifo(dir / "metrics.jsonl", [&] { bench::compare_runs(dir / "metrics.jsonl", dir / "metrics.jsonl", {}); }),
              HasSubstr((dir / "metrics.jsonl").string() + ": " + fifo));
  EXPECT_THAT(error_on_fifo(dir / "fit.jsonl", [&] { plan::fit_collective_seconds(plan::Calibration{}, dir / "fit.jsonl"); }),
              HasSubstr((dir / "fit.jsonl").string() + ": cannot be read"));
  EXPECT_THAT(error_on_fifo(dir / "w.safetensors", [&] { models::read_safetensors_header(dir / "w.safetensors"); }),
              HasSubstr("cannot open " + (dir / "w.safetensors").string() + ": " + fifo));
  const fs::path job = dir / "job";
  fs::create_directories(job);
  test::write_file(job / "plan.json", "{}");
  EXPECT_THAT(error_on_fifo(job / "logical.json", [&] { plan::read_dump(job); }), HasSubstr((job / "logical.json").string() + ": " + fifo));
}

}  // namespace
}  // namespace spmdx
