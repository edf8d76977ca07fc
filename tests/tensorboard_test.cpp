// TensorBoard event files (spmdx/metrics/tensorboard.h): the TFRecord framing checked byte by
// byte here, each record parsed back with the generated Event class, and the files read by the
// real TensorBoard (tests/reference/read_tensorboard.py, with the project's Python).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "event.pb.h"
#include "spmdx/metrics/tensorboard.h"
#include "test_util.h"

namespace spmdx::metrics {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::uint64_t le(const std::string& bytes, std::size_t at, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= std::uint64_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
  return v;
}

// TFRecord's mask, written out again here rather than taken from the library.
std::uint32_t mask(std::uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

// The Events of a file, each record's framing checked (a failed check names the record).
std::vector<tf::Event> read_events(const fs::path& file) {
  const std::string bytes = read(file);
  std::vector<tf::Event> out;
  std::size_t at = 0;
  while (at < bytes.size()) {
    const std::string where = file.filename().string() + " record " + std::to_string(out.size()) + " at byte " + std::to_string(at);
    if (bytes.size() - at < 12) {
      ADD_FAILURE() << where << ": a truncated header";
      break;
    }
    const std::uint64_t length = le(bytes, at, 8);
    EXPECT_EQ(le(bytes, at + 8, 4), mask(crc32c(std::string_view(bytes).substr(at, 8)))) << where << ": length CRC";
    if (bytes.size() - at - 12 < length + 4) {
      ADD_FAILURE() << where << ": length " << length << " runs past the end of the file";
      break;
    }
    const std::string data = bytes.substr(at + 12, length);
    EXPECT_EQ(le(bytes, at + 12 + length, 4), mask(crc32c(data))) << where << ": data CRC";
    tf::Event event;
    EXPECT_TRUE(event.ParseFromString(data)) << where << ": not an Event";
    out.push_back(event);
    at += 12 + length + 4;
  }
  return out;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(TensorBoardFraming, Crc32cKnownVectors) {
  // The check value of the CRC catalogue (CRC-32/ISCSI) and RFC 3720's B.4 examples.
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(static_cast<char>(i));
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(masked_crc32c("123456789"), mask(0xE3069283u));
}

TEST(TensorBoardFraming, TfRecord) {
  const std::string r = tfrecord("abc");
  ASSERT_EQ(r.size(), 8u + 4 + 3 + 4);
  EXPECT_EQ(le(r, 0, 8), 3u);
  EXPECT_EQ(le(r, 8, 4), mask(crc32c(r.substr(0, 8))));
  EXPECT_EQ(r.substr(12, 3), "abc");
  EXPECT_EQ(le(r, 15, 4), mask(crc32c("abc")));
  EXPECT_EQ(tfrecord("").size(), 16u);
}

TEST(TensorBoardWriter, WritesTheVersionThenOneEventPerScalar) {
  test::TempDir dir;
  const double before = unix_time_s();
  fs::path file;
  {
    EventWriter w(dir / "tb" / "run");  // parents created
    file = w.file();
    w.add_scalar("loss_metrics/global_avg_loss", 10.25, 1, 1000.5);
    w.add_scalar("lr", 3e-4, 1, 1000.5);
    w.add_scalar("loss_metrics/global_avg_loss", 9.75, 2, 1001.5);
    w.add_scalar("grad_norm", -1.5, std::int64_t{1} << 40, 1002.0);
    w.flush();
  }
  EXPECT_EQ(file.parent_path(), dir / "tb" / "run");
  const auto events = read_events(file);
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  EXPECT_EQ(events[0].step(), 0);
  EXPECT_GE(events[0].wall_time(), before);
  EXPECT_LE(events[0].wall_time(), unix_time_s());
  struct Want {
    std::string tag;
    float value;
    std::int64_t step;
    double wall_time;
  };
  const std::vector<Want> want = {{"loss_metrics/global_avg_loss", 10.25f, 1, 1000.5},
                                  {"lr", 3e-4f, 1, 1000.5},
                                  {"loss_metrics/global_avg_loss", 9.75f, 2, 1001.5},
                                  {"grad_norm", -1.5f, std::int64_t{1} << 40, 1002.0}};
  for (std::size_t i = 0; i < want.size(); ++i) {
    const tf::Event& e = events[i + 1];
    SCOPED_TRACE("scalar " + std::to_string(i));
    ASSERT_TRUE(e.has_summary());
    ASSERT_EQ(e.summary().value_size(), 1);
    EXPECT_EQ(e.summary().value(0).tag(), want[i].tag);
    EXPECT_TRUE(e.summary().value(0).has_simple_value());
    EXPECT_EQ(e.summary().value(0).simple_value(), want[i].value);
    EXPECT_EQ(e.step(), want[i].step);
    EXPECT_EQ(e.wall_time(), want[i].wall_time);
  }
}

TEST(TensorBoardWriter, FileNameIsTorchs) {
  test::TempDir dir;
  EventWriter a(dir.path());
  EventWriter b(dir.path());
  char host[256] = {};
  ASSERT_EQ(::gethostname(host, sizeof(host) - 1), 0);
  const std::regex form(R"(events\.out\.tfevents\.[0-9]{10,}\.)" + std::string(host) + "\\." + std::to_string(::getpid()) +
                        R"(\.[0-9]+)");
  EXPECT_TRUE(std::regex_match(a.file().filename().string(), form)) << a.file();
  EXPECT_TRUE(std::regex_match(b.file().filename().string(), form)) << b.file();
  EXPECT_NE(a.file(), b.file());
  EXPECT_TRUE(fs::exists(a.file()) && fs::exists(b.file()));
}

TEST(TensorBoardWriter, FlushWritesWhatIsBufferedAndTheDestructorTheRest) {
  test::TempDir dir;
  fs::path file;
  {
    EventWriter w(dir.path());
    file = w.file();
    EXPECT_EQ(read_events(file).size(), 1u) << "the version record is written at once";
    w.add_scalar("loss", 1.0, 1);
    EXPECT_EQ(read_events(file).size(), 1u) << "scalars wait for flush()";
    w.flush();
    EXPECT_EQ(read_events(file).size(), 2u);
    w.flush();  // nothing buffered: nothing written twice
    EXPECT_EQ(read_events(file).size(), 2u);
    w.add_scalar("loss", 0.5, 2);
  }
  const auto events = read_events(file);
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[2].step(), 2);
  EXPECT_EQ(events[2].summary().value(0).simple_value(), 0.5f);
}

TEST(TensorBoardWriter, AFullBufferIsWrittenWithoutFlush) {
  test::TempDir dir;
  EventWriter w(dir.path());
  const auto version_bytes = fs::file_size(w.file());
  for (int step = 1; step <= 40000; ++step) w.add_scalar("loss_metrics/global_avg_loss", 1.0 / step, step);  // ~2 MB
  EXPECT_GT(fs::file_size(w.file()), version_bytes + (std::uintmax_t{1} << 20));
  w.flush();
  const auto events = read_events(w.file());
  ASSERT_EQ(events.size(), 40001u);
  EXPECT_EQ(events.back().step(), 40000);
}

TEST(TensorBoardWriter, MovedWriterKeepsItsFile) {
  test::TempDir dir;
  EventWriter a(dir.path());
  const fs::path file = a.file();
  EventWriter b = std::move(a);
  b.add_scalar("loss", 2.0, 7);
  b.flush();
  EXPECT_EQ(b.file(), file);
  EXPECT_EQ(read_events(file).size(), 2u);
}

TEST(TensorBoardWriter, ValuesAreFloat32AsTensorBoardKeepsThem) {
  test::TempDir dir;
  EventWriter w(dir.path());
  w.add_scalar("big", 1e300, 1);
  w.add_scalar("small", -1e300, 1);
  w.add_scalar("nan", std::numeric_limits<double>::quiet_NaN(), 1);
  w.add_scalar("pi", 3.14159265358979, 1);
  w.flush();
  const auto events = read_events(w.file());
  ASSERT_EQ(events.size(), 5u);
  EXPECT_EQ(events[1].summary().value(0).simple_value(), std::numeric_limits<float>::infinity());
  EXPECT_EQ(events[2].summary().value(0).simple_value(), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(events[3].summary().value(0).simple_value()));
  EXPECT_EQ(events[4].summary().value(0).simple_value(), 3.14159265358979f);
}

TEST(TensorBoardWriter, Errors) {
  test::TempDir dir;
  // A folder that cannot be made (a file stands in its way; root can't get past that either).
  test::write_file(dir / "a_file", "x");
  const fs::path bad = dir / "a_file" / "tb";
  EXPECT_THAT(error_of([&] { EventWriter w(bad); }), HasSubstr(bad.string()));
  EXPECT_THROW(EventWriter w(bad), std::runtime_error);
  // A folder without write permission (root writes there anyway).
  if (::geteuid() != 0) {
    const fs::path ro = dir / "read_only";
    fs::create_directory(ro);
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    const std::string e = error_of([&] { EventWriter w(ro); });
    EXPECT_THAT(e, HasSubstr((ro / "events.out.tfevents.").string()));
    EXPECT_THAT(e, HasSubstr("Permission denied"));
  }
  EventWriter w(dir.path());
  EXPECT_THROW(w.add_scalar("", 1.0, 1), std::invalid_argument);
}

// ----- the real TensorBoard -----

// Why the TensorBoard reference cannot run here, or "" when it can.
std::string reference_missing() {
  static const std::string why = [] {
    if (!fs::exists(SPMDX_PYTHON)) return std::string("no " SPMDX_PYTHON " (run scripts/setup)");
    if (test::run_command("'" SPMDX_PYTHON "' -c 'import tensorboard'").exit_code != 0) {
      return std::string("the Python package `tensorboard` is missing from " SPMDX_PYTHON " (run scripts/setup)");
    }
    return std::string();
  }();
  return why;
}

test::CommandResult read_tensorboard(const fs::path& folder, const std::string& args = "") {
  return test::run_command("'" SPMDX_PYTHON "' '" SPMDX_SOURCE_DIR "/tests/reference/read_tensorboard.py' '" + folder.string() +
                           "' " + args);
}

// A run's scalars, as the training loop will write them: several tags a step, flushed each step.
void write_run(const fs::path& folder) {
  EventWriter w(folder);
  for (int step = 1; step <= 20; ++step) {
    w.add_scalar("loss_metrics/global_avg_loss", 10.0 / step, step);
    w.add_scalar("lr", 1e-4 * step, step);
    w.add_scalar("throughput(tps)", 1234.5 + step, step);
    if (step % 10 == 0) w.add_scalar("validation_metrics/loss", 5.0 / step, step);
    w.flush();
  }
}

TEST(TensorBoardReference, ReadsEveryScalar) {
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  test::TempDir dir;
  write_run(dir / "tb");
  std::string expected = "{";
  for (const char* tag : {"loss_metrics/global_avg_loss", "lr", "throughput(tps)", "validation_metrics/loss"}) {
    expected += std::string(expected.size() > 1 ? "," : "") + "\"" + tag + "\":{";
    bool first = true;
    for (int step = 1; step <= 20; ++step) {
      const std::string t = tag;
      const double v = t == "lr" ? 1e-4 * step : t == "throughput(tps)" ? 1234.5 + step : t == "validation_metrics/loss" ? 5.0 / step : 10.0 / step;
      if (t == "validation_metrics/loss" && step % 10 != 0) continue;
      char number[64];
      std::snprintf(number, sizeof(number), "%.17g", v);
      expected += std::string(first ? "" : ",") + "\"" + std::to_string(step) + "\":" + number;
      first = false;
    }
    expected += "}";
  }
  expected += "}";
  test::write_file(dir / "expected.json", expected);
  const auto r = read_tensorboard(dir / "tb", "--expect '" + (dir / "expected.json").string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"loss_metrics/global_avg_loss\": {"));
  EXPECT_THAT(r.output, HasSubstr("\"20\": 0.25"));  // validation_metrics/loss at step 20, exact in float32
}

TEST(TensorBoardReference, CatchesAWrongValueAndAMissingStep) {
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  test::TempDir dir;
  write_run(dir / "tb");
  test::write_file(dir / "expected.json", R"({"lr": {"1": 0.0001, "2": 0.0003}, "grad_norm": {"1": 1.0}})");
  const auto r = read_tensorboard(dir / "tb", "--expect '" + (dir / "expected.json").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tag 'lr' step 2: 0.00019999"));
  EXPECT_THAT(r.output, HasSubstr("tag 'lr' step 3: not expected"));
  EXPECT_THAT(r.output, HasSubstr("tag 'grad_norm': missing"));
}

// TensorBoard checks the CRCs and stops at the first bad record: a flipped bit in the last
// record's data CRC drops that record, so ours are what it computes.
TEST(TensorBoardReference, DropsARecordWithABadCrc) {
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  test::TempDir dir;
  fs::path file;
  {
    EventWriter w(dir / "tb");
    file = w.file();
    w.add_scalar("loss", 1.0, 1);
    w.add_scalar("loss", 2.0, 2);
  }
  std::string bytes = read(file);
  bytes[bytes.size() - 1] = static_cast<char>(bytes[bytes.size() - 1] ^ 0x01);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
  test::write_file(dir / "expected.json", R"({"loss": {"1": 1.0, "2": 2.0}})");
  const auto r = read_tensorboard(dir / "tb", "--expect '" + (dir / "expected.json").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tag 'loss' step 2: missing"));
}

TEST(TensorBoardReference, NonFiniteValuesAndNoEventFiles) {
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  test::TempDir dir;
  {
    EventWriter w(dir / "tb");
    w.add_scalar("loss", std::numeric_limits<double>::quiet_NaN(), 1);
    w.add_scalar("loss", std::numeric_limits<double>::infinity(), 2);
  }
  test::write_file(dir / "expected.json", R"({"loss": {"1": "NaN", "2": "Infinity"}})");
  auto r = read_tensorboard(dir / "tb", "--expect '" + (dir / "expected.json").string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("\"1\": \"NaN\""));
  fs::create_directory(dir / "empty");
  r = read_tensorboard(dir / "empty");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("no event files"));
}

}  // namespace
}  // namespace spmdx::metrics
