// The data pipeline: tokenizers (checked id for id against the Hugging Face `tokenizers`
// library, run through the repository's .venv) and the text data set's batches.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "spmdx/data/text_dataset.h"
#include "spmdx/data/tokenizer.h"
#include "test_util.h"

namespace spmdx::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;
using Ids = std::vector<std::int64_t>;

// __FILE__ may be relative to the top build folder (ccache's base_dir makes it so), which is
// two levels above TEST_PLUGIN_DIR (<build>/tests/plugins).
fs::path source_file() {
  const fs::path file(__FILE__);
  return file.is_absolute() ? file : fs::path(TEST_PLUGIN_DIR).parent_path().parent_path() / file;
}
const fs::path kRepo = fs::weakly_canonical(source_file()).parent_path().parent_path();
const fs::path kSharedData = kRepo / ".." / "shared" / "data";
const fs::path kPython = kRepo / ".venv" / "bin" / "python";

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Why the Hugging Face reference cannot run here, or "" when it can.
std::string reference_missing() {
  static const std::string why = [] {
    if (!fs::exists(kPython)) return "no " + kPython.string() + " (run scripts/setup)";
    if (test::run_command("'" + kPython.string() + "' -c 'import tokenizers'").exit_code != 0) {
      return "the Python package `tokenizers` is missing from " + kPython.string() + " (run scripts/setup)";
    }
    return std::string();
  }();
  return why;
}

struct Reference {
  std::vector<Ids> ids;              // Tokenizer.from_file(path).encode(text).ids
  std::vector<std::string> decoded;  // .decode(ids), of `ids` and then of each extra id list
};

// Runs the `tokenizers` library on `texts`, and decodes their ids and then `decode`.
Reference hf_reference(const fs::path& tokenizer, const std::vector<std::string>& texts, const std::vector<Ids>& decode = {}) {
  test::TempDir dir;
  test::write_file(dir / "in.json", json{{"texts", texts}, {"decode", decode}}.dump());
  test::write_file(dir / "ref.py",
                   "import json, sys\n"
                   "from tokenizers import Tokenizer\n"
                   "t = Tokenizer.from_file(sys.argv[1])\n"
                   "inp = json.load(open(sys.argv[2], encoding='utf-8'))\n"
                   "ids = [t.encode(s).ids for s in inp['texts']]\n"
                   "dec = [t.decode(i) for i in ids + inp['decode']]\n"
                   "json.dump({'ids': ids, 'decoded': dec}, open(sys.argv[3], 'w', encoding='utf-8'))\n");
  const auto run = test::run_command("'" + kPython.string() + "' " + (dir / "ref.py").string() + " '" + tokenizer.string() +
                                     "' " + (dir / "in.json").string() + " " + (dir / "out.json").string());
  if (run.exit_code != 0) throw std::runtime_error("the tokenizers reference failed:\n" + run.output);
  const json out = json::parse(read(dir / "out.json"));
  return {out["ids"].get<std::vector<Ids>>(), out["decoded"].get<std::vector<std::string>>()};
}

// Texts that reach every branch of byte-level pre-tokenization.
std::vector<std::string> sample_texts() {
  return {"Hello, world!",
          "line one\nline two\n\n\tindented\n",
          "  leading and trailing  ",
          "a  b   c    d",
          "it's (we'll) don't!? ... --- \"quoted\" [x]{y} I'LL 'S 're 've 'm 'd",
          "h\xC3\xA9llo w\xC3\xB6rld \xE2\x80\x94 \xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x99\x82 \xC2\xBD \xC2\xB2\xC2\xB3 \xD9\xA3",
          "",
          "12345 3.14 1,000 x2",
          "<|begin_of_text|>hi<|end_of_text|>",
          "\xE3\x80\x80x\xC2\xA0y\r\nz \n",
          " ",
          "\n"};
}

// Deterministic mixtures of the pieces tokenizers trip on.
std::vector<std::string> mixed_texts(int count) {
  const std::vector<std::string> pieces = {
      "a", "b", "c", "ab", "abc", "the", " ", "  ", "\n", "\t", "'", "'s", "'ll", "1", "23", "!", "?!", "_",
      "word", "words", "<|eot|>", "<|tool|>", "<|e", "\xC3\xA9", "\xE6\x97\xA5", "\xF0\x9F\x99\x82", "\xC2\xA0", "x"};
  std::vector<std::string> texts;
  std::uint64_t state = 12345;
  for (int i = 0; i < count; ++i) {
    std::string text;
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const auto n = static_cast<int>((state >> 33) % 30);
    for (int k = 0; k < n; ++k) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      text += pieces[(state >> 33) % pieces.size()];
    }
    texts.push_back(text);
  }
  return texts;
}

// GPT-2's bytes_to_unicode, to write synthetic byte-level vocabularies.
std::vector<std::string> byte_chars() {
  std::vector<std::string> chars(256);
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : next++;
    chars[static_cast<std::size_t>(b)] = cp < 0x80 ? std::string(1, static_cast<char>(cp))
                                                   : std::string{static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
  }
  return chars;
}

json added(const std::string& content, bool special, bool lstrip = false, bool rstrip = false, bool single_word = false) {
  return {{"id", 0}, {"content", content}, {"single_word", single_word}, {"lstrip", lstrip},
          {"rstrip", rstrip}, {"normalized", !special}, {"special", special}};
}

// A GPT-2 style tokenizer: the byte alphabet, merges (two of them making the same token, so
// stale merge candidates matter), added tokens of every kind, a BOS template.
json byte_level_bpe(bool string_merges) {
  const auto chars = byte_chars();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[chars[static_cast<std::size_t>(b)]] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"\xC4\xA0", "t"}, {"h", "e"}, {"\xC4\xA0t", "he"}, {"i", "n"}, {"\xC4\xA0", "a"}, {"e", "r"},
      {"\xC4\xA0", "\xC4\xA0"}, {"\xC4\xA0\xC4\xA0", "\xC4\xA0"}, {"\xC4\xA0", "\xC4\x8A"}, {"\xC4\x8A", "\xC4\x8A"},
      {"a", "b"}, {"b", "c"}, {"ab", "c"}, {"a", "bc"}, {"\xC3\x83", "\xC2\xA9"}, {"\xC4\xA0", "w"}, {"o", "r"},
      {"\xC4\xA0w", "or"}, {"'", "s"}, {"1", "2"}, {"12", "3"}};
  json merge_list = json::array();
  for (const auto& [a, b] : merges) {
    if (!vocab.contains(a + b)) vocab[a + b] = vocab.size();
    merge_list.push_back(string_merges ? json(a + " " + b) : json::array({a, b}));
  }
  return {{"version", "1.0"},
          {"added_tokens", {added("<|eot|>", true), added("<|tool|>", false, true, true), added("word", false, false, false, true),
                            added("<|e", false), added("ab", true)}},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single", {{{"SpecialToken", {{"id", "<|eot|>"}, {"type_id", 0}}}}, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair", {{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"special_tokens", {{"<|eot|>", {{"id", "<|eot|>"}, {"ids", {vocab.size()}}, {"tokens", {"<|eot|>"}}}}}}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", false},
            {"vocab", vocab}, {"merges", merge_list}}}};
}

// A character-level BPE without pre-tokenizer or decoder: unknown characters, byte fallback,
// subword prefix and word suffix.
json char_bpe(bool fuse_unk, bool byte_fallback, bool affixes) {
  json vocab = json::object();
  const std::string prefix = affixes ? "##" : "", suffix = affixes ? "</w>" : "";
  for (char c = 'a'; c <= 'f'; ++c) {
    for (const std::string& v : {std::string(1, c), prefix + c, std::string(1, c) + suffix, prefix + c + suffix}) {
      if (!vocab.contains(v)) vocab[v] = vocab.size();
    }
  }
  vocab["<unk>"] = vocab.size();
  vocab["<0x20>"] = vocab.size();
  vocab["<0x0A>"] = vocab.size();
  json merges = json::array();
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"a", prefix + "b"}, {"ab", prefix + "c"}, {"d", prefix + "e"}, {"c", prefix + "a"}}) {
    if (!vocab.contains(a + b.substr(prefix.size()))) vocab[a + b.substr(prefix.size())] = vocab.size();
    merges.push_back(json::array({a, b}));
  }
  return {{"version", "1.0"},         {"added_tokens", json::array({added("<unk>", true)})},
          {"normalizer", nullptr},    {"pre_tokenizer", nullptr},
          {"post_processor", nullptr}, {"decoder", nullptr},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", "<unk>"},
            {"continuing_subword_prefix", affixes ? json(prefix) : json()},
            {"end_of_word_suffix", affixes ? json(suffix) : json()}, {"fuse_unk", fuse_unk},
            {"byte_fallback", byte_fallback}, {"ignore_merges", affixes}, {"vocab", vocab}, {"merges", merges}}}};
}

void expect_same_as_reference(const fs::path& path, std::vector<std::string> texts, const std::vector<Ids>& decode = {}) {
  const HuggingFaceTokenizer tok(path.string());
  const Reference ref = hf_reference(path, texts, decode);
  ASSERT_EQ(ref.ids.size(), texts.size());
  for (std::size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(tok.encode(texts[i]), ref.ids[i]) << path.filename() << " text " << i << ": " << json(texts[i]).dump();
    EXPECT_EQ(tok.decode(ref.ids[i]), ref.decoded[i]) << path.filename() << " text " << i << ": " << json(texts[i]).dump();
  }
  for (std::size_t i = 0; i < decode.size(); ++i) {
    EXPECT_EQ(tok.decode(decode[i]), ref.decoded[texts.size() + i]) << path.filename() << " decode " << i;
  }
}

TEST(ByteTokenizer, RoundTripsUtf8ByteForByte) {
  ByteTokenizer tok;
  const std::string text = "h\xC3\xA9llo \xF0\x9F\x99\x82\n";  // "héllo 🙂\n"
  EXPECT_EQ(tok.encode(text), (Ids{'h', 0xC3, 0xA9, 'l', 'l', 'o', ' ', 0xF0, 0x9F, 0x99, 0x82, '\n'}));
  EXPECT_EQ(tok.decode(tok.encode(text)), text);
  EXPECT_EQ(tok.encode(""), Ids{});
  EXPECT_EQ(tok.decode(Ids{72, 300, -1, 105}), "Hi");  // unknown ids are skipped
  EXPECT_NE(dynamic_cast<ByteTokenizer*>(make_tokenizer("byte").get()), nullptr);
}

// The byte tokenizer's BOS and EOS are the two ids after the bytes; encode() never gives them,
// encode_document() puts them around a document, decode() skips them.
TEST(ByteTokenizer, DocumentsGetBos256AndEos257) {
  ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 264);
  EXPECT_EQ(tok.bos_id(), 256);
  EXPECT_EQ(tok.eos_id(), 257);
  EXPECT_EQ(tok.encode("hi"), (Ids{'h', 'i'}));
  EXPECT_EQ(encode_document(tok, "hi"), (Ids{256, 'h', 'i', 257}));
  EXPECT_EQ(encode_document(tok, ""), (Ids{256, 257}));  // the data set skips empty documents
  EXPECT_EQ(tok.decode(Ids{256, 'h', 'i', 257, 256}), "hi");
}

TEST(HuggingFaceTokenizer, TorchtitanTestTokenizerMatchesTokenizersLibrary) {
  const fs::path path = kSharedData / "tokenizer.json";
  if (!fs::exists(path)) GTEST_SKIP() << "no " << path << " (the shared data folder is not on this machine)";
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  auto texts = sample_texts();
  texts.push_back(read(kSharedData / "tinyshakespeare.txt").substr(0, 20000));
  texts.push_back(read(kSharedData / "wikitext2_valid.txt").substr(0, 20000));
  expect_same_as_reference(path, texts, {{2002, 72, 105, 2003}, {0, 127, 128, 255, 256, 2019, 5000}});

  const auto tok = make_tokenizer(kSharedData.string());  // a folder holding tokenizer.json
  EXPECT_EQ(tok->vocab_size(), 2020);
  EXPECT_EQ(tok->bos_id(), 2002);  // "<|begin_of_text|>" in tokenizer_config.json
  EXPECT_EQ(tok->eos_id(), 2003);  // "<|end_of_text|>"
  // One id per character; spaces and newlines have no token in this vocabulary and vanish.
  EXPECT_EQ(tok->encode("Hi there\n!"), (Ids{72, 105, 116, 104, 101, 114, 101, 33}));
}

TEST(HuggingFaceTokenizer, SyntheticTokenizersMatchTokenizersLibrary) {
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  test::TempDir dir;
  auto texts = sample_texts();
  for (const auto& t : mixed_texts(60)) texts.push_back(t);
  for (std::string extra : {"abc abcabc abca", "the weather in the north", "x<|eot|>y  <|tool|>  z", "a word, words sword word_",
                            "<|eot|><|eot|> <|e<|eot|>", "ab abc cab", "  \n\n  x \n", "123 1234 12"}) {
    texts.push_back(extra);
  }
  const std::vector<Ids> decode = {{0xC3}, {0xC3, 0xA9}, {0x41, 0xE6, 0x97, 0x41}, {1000000, 72}};
  for (bool string_merges : {false, true}) {
    const fs::path path = dir / ("byte_level_" + std::to_string(string_merges) + ".json");
    test::write_file(path, byte_level_bpe(string_merges).dump());
    expect_same_as_reference(path, texts, decode);
  }
  const std::vector<std::string> char_texts = {"abcabc", "abzzcab", "zzz", "a b\nc", "dedede", "", "\xC3\xA9" "ab \xE6\x97\xA5",
                                               "fabcdef zz\n", "cacab"};
  for (auto [fuse, fallback, affixes] : {std::tuple{false, false, false}, std::tuple{true, false, false},
                                         std::tuple{false, true, false}, std::tuple{true, true, true}}) {
    const fs::path path = dir / ("char_" + std::to_string(fuse) + std::to_string(fallback) + std::to_string(affixes) + ".json");
    test::write_file(path, char_bpe(fuse, fallback, affixes).dump());
    expect_same_as_reference(path, char_texts, {{0, 1, 2}});
  }
}

TEST(HuggingFaceTokenizer, AddedTokensGetTheIdsTokenizersGives) {
  test::TempDir dir;
  const fs::path path = dir / "tokenizer.json";
  test::write_file(path, byte_level_bpe(false).dump());
  const HuggingFaceTokenizer tok(path.string());
  // The vocabulary has 256 bytes + 20 merged tokens ("ab" among them); new added tokens follow it.
  EXPECT_EQ(tok.token_to_id("<|eot|>"), 276);
  EXPECT_EQ(tok.token_to_id("<|tool|>"), 277);
  EXPECT_EQ(tok.token_to_id("ab"), 266);  // already in the vocabulary: keeps its id
  EXPECT_EQ(tok.vocab_size(), 280);
  EXPECT_EQ(tok.bos_id(), std::nullopt);  // no tokenizer_config.json beside it
  // The template puts 276 first; "<|tool|>" takes the spaces around it (lstrip, rstrip), and
  // each side gets its own prefix space (Ġ is byte 0x20, id 32).
  EXPECT_EQ(tok.encode("x  <|tool|>  y"), (Ids{276, 32, 'x', 277, 32, 'y'}));
  EXPECT_EQ(tok.decode(tok.encode("x  <|tool|>  y")), " x<|tool|> y");  // special tokens skipped
  // Text that is not UTF-8: a stray byte is one more punctuation character; decoding gives U+FFFD.
  EXPECT_EQ(tok.encode("\xC3("), (Ids{276, 32, 0xC3, '('}));
  EXPECT_EQ(tok.decode(Ids{0xC3, '('}), "\xEF\xBF\xBD(");
  std::uint64_t state = 99;
  for (int i = 0; i < 2000; ++i) {
    std::string bytes;
    for (int k = 0; k < i % 40; ++k) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      bytes += static_cast<char>(state >> 56);
    }
    for (std::int64_t id : tok.encode(bytes)) ASSERT_LT(id, tok.vocab_size());
  }
}

// The file's ids of added tokens are not the ids they get (tokenizers numbers them after the
// vocabulary): said once, as tokenizers warns, since a checkpoint trained with the file's ids
// would read other embedding rows.
TEST(HuggingFaceTokenizer, AddedTokensWhoseFileIdsDifferAreWarnedOf) {
  test::TempDir dir;
  json j = byte_level_bpe(false);
  j["added_tokens"][0]["id"] = 5000;  // "<|eot|>"
  for (std::size_t i = 1; i < j["added_tokens"].size(); ++i) j["added_tokens"][i]["id"] = std::vector<int>{277, 278, 279, 266}.at(i - 1);
  test::write_file(dir / "tokenizer.json", j.dump());
  testing::internal::CaptureStderr();
  const HuggingFaceTokenizer tok((dir / "tokenizer.json").string());
  const std::string warned = testing::internal::GetCapturedStderr();
  EXPECT_EQ(tok.token_to_id("<|eot|>"), 276);
  EXPECT_THAT(warned, HasSubstr("1 added token gets another id than the file's (\"<|eot|>\" gets 276, the file says 5000)"));
  j["added_tokens"][0]["id"] = 276;  // the ids it gets: nothing to say
  test::write_file(dir / "tokenizer.json", j.dump());
  testing::internal::CaptureStderr();
  const HuggingFaceTokenizer same((dir / "tokenizer.json").string());
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

// One id far past the others makes a vocabulary of millions of rows no token uses: said, with
// the id, its token and the count, since the model's vocabulary is the largest id + 1. A
// tokenizer whose ids are dense says nothing of it.
TEST(HuggingFaceTokenizer, AnIdFarPastTheOthersIsWarnedOf) {
  test::TempDir dir;
  json j = byte_level_bpe(false);
  j["model"]["vocab"]["ab"] = (1 << 24) - 1;
  j["model"]["merges"] = json::array();
  test::write_file(dir / "gap.json", j.dump());
  testing::internal::CaptureStderr();
  const HuggingFaceTokenizer gap((dir / "gap.json").string());
  const std::string warned = testing::internal::GetCapturedStderr();
  EXPECT_EQ(gap.vocab_size(), 1 << 24);
  const auto defined = static_cast<std::int64_t>(j["model"]["vocab"].size()) + 4;  // and the 4 added tokens not in the vocab
  EXPECT_THAT(warned, HasSubstr("tokenizer '" + (dir / "gap.json").string() + "': its largest id, 16777215 (\"ab\"), makes a vocabulary of 16777216 ids for the " +
                                std::to_string(defined) + " tokens it defines: the " + std::to_string((1 << 24) - defined) +
                                " ids no token has still get a row each in the embedding and the output"));
  test::write_file(dir / "dense.json", byte_level_bpe(false).dump());
  testing::internal::CaptureStderr();
  const HuggingFaceTokenizer dense((dir / "dense.json").string());
  EXPECT_THAT(testing::internal::GetCapturedStderr(), Not(HasSubstr("largest id")));
}

TEST(HuggingFaceTokenizer, BadFilesNameTheFileAndTheReason) {
  test::TempDir dir;
  const std::string missing = (dir / "nope" / "tokenizer.json").string();
  EXPECT_THAT(error_of([&] { make_tokenizer(missing); }), HasSubstr("'" + missing + "': the file does not exist. Pass \"byte\""));

  const fs::path broken = dir / "broken.json";
  test::write_file(broken, "{\"model\": {\"type\": \"BPE\",");
  EXPECT_THAT(error_of([&] { make_tokenizer(broken.string()); }),
              HasSubstr("cannot load tokenizer '" + broken.string() + "': not valid JSON ("));

  auto variant = [&](const std::string& name, auto&& change) {
    json j = byte_level_bpe(false);
    change(j);
    test::write_file(dir / name, j.dump());
    return error_of([&] { make_tokenizer((dir / name).string()); });
  };
  EXPECT_THAT(variant("unigram.json", [](json& j) { j["model"]["type"] = "Unigram"; }),
              HasSubstr("unigram.json': model type \"Unigram\" is not supported (spmdx supports BPE)"));
  EXPECT_THAT(variant("meta.json", [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}}; }),
              HasSubstr("meta.json': pre-tokenizer type \"Metaspace\" is not supported (spmdx supports ByteLevel)"));
  EXPECT_THAT(variant("nfc.json", [](json& j) { j["normalizer"] = {{"type", "NFC"}}; }),
              HasSubstr("nfc.json': normalizer type \"NFC\" is not supported"));
  EXPECT_THAT(variant("merge.json", [](json& j) { j["model"]["merges"].push_back({"q", "zz"}); }),
              HasSubstr("merge.json': merge 22 uses \"zz\", which is not in the vocabulary"));
  EXPECT_THAT(variant("vocab.json", [](json& j) { j["model"]["vocab"] = 3; }),
              HasSubstr("vocab.json': its model.vocab is not a JSON object"));
  EXPECT_THAT(variant("id.json", [](json& j) { j["model"]["vocab"]["a"] = "one"; }),
              HasSubstr("id.json': model.vocab maps \"a\" to \"one\", not an id in [0, 16777216)"));
  EXPECT_THAT(variant("neg.json", [](json& j) { j["model"]["vocab"]["a"] = -7; }), HasSubstr("maps \"a\" to -7"));
  // Two tokens with one id would train as one; an id missing from the vocab makes the next added
  // token ("<|eot|>", numbered from the vocab's 276 entries) take the id of a vocab token.
  // An added token's id in the file must be an id (Hugging Face tokenizers refuses others too).
  EXPECT_THAT(variant("minus.json", [](json& j) { j["added_tokens"][0]["id"] = -1; }),
              HasSubstr("minus.json': added_tokens[0] has the id -1, not an id from 0 to 2^32 - 1"));
  EXPECT_THAT(variant("text_id.json", [](json& j) { j["added_tokens"][1]["id"] = "7"; }), HasSubstr("added_tokens[1] has the id \"7\", not an id"));
  EXPECT_THAT(variant("big_id.json", [](json& j) { j["added_tokens"][1]["id"] = 4294967296ll; }), HasSubstr("added_tokens[1] has the id 4294967296, not an id"));
  EXPECT_THAT(variant("twice.json", [](json& j) { j["model"]["vocab"]["zz"] = j["model"]["vocab"]["a"]; }),
              HasSubstr("twice.json': model.vocab maps both \"a\" and \"zz\" to 97: the two would train as one token"));
  EXPECT_THAT(variant("gap.json", [](json& j) { j["model"]["vocab"]["ab"] = 276; }),
              HasSubstr("gap.json': added token \"<|eot|>\" gets id 276 (Hugging Face tokenizers numbers new added tokens from model.vocab's count of "
                        "entries, 276), which model.vocab gives \"ab\": the vocab's ids have gaps"));

  // A value of the wrong JSON type is named by its path in the file, not by the JSON library's
  // "type must be string, but is number".
  const std::string todo = ". The file does not follow the Hugging Face tokenizer.json format: fix that value";
  const std::vector<std::pair<std::function<void(json&)>, std::string>> wrong_types = {
      {[](json& j) { j["added_tokens"][0]["content"] = 5; }, "/added_tokens/0/content is 5, not a string"},
      {[](json& j) { j["added_tokens"][1] = "<|eot|>"; }, "/added_tokens/1 is \"<|eot|>\", not an object"},
      {[](json& j) { j["model"]["merges"][2] = 7; }, "/model/merges/2 is 7, not a merge (\"a b\" or [\"a\", \"b\"])"},
      {[](json& j) { j["model"]["merges"][0] = {"a", 5}; }, "/model/merges/0/1 is 5, not a string"},
      {[](json& j) { j["model"]["continuing_subword_prefix"] = 3; }, "/model/continuing_subword_prefix is 3, not a string"},
      {[](json& j) { j["model"]["dropout"] = "0.1"; }, "/model/dropout is \"0.1\", not a number"},
      {[](json& j) { j["pre_tokenizer"]["add_prefix_space"] = "yes"; }, "/pre_tokenizer/add_prefix_space is \"yes\", not true or false"},
      {[](json& j) { j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", {{{"SpecialToken", {{"id", 1}}}}}}}; },
       "/post_processor/single/0/SpecialToken/id is 1, not a string"},
      {[](json& j) { j["post_processor"] = {{"type", "BertProcessing"}, {"cls", {"[CLS]", "1"}}, {"sep", {"[SEP]", 2}}}; },
       "/post_processor/cls/1 is \"1\", not a whole number"},
  };
  for (std::size_t i = 0; i < wrong_types.size(); ++i) {
    const std::string name = "type" + std::to_string(i) + ".json";
    const std::string e = variant(name, wrong_types[i].first);
    EXPECT_THAT(e, HasSubstr("cannot load tokenizer '" + (dir / name).string() + "': " + wrong_types[i].second + todo)) << i;
    EXPECT_THAT(e, Not(HasSubstr("type must be"))) << i;
  }

  test::write_file(dir / "tokenizer.json", byte_level_bpe(false).dump());
  test::write_file(dir / "tokenizer_config.json", R"({"bos_token": 5})");
  EXPECT_THAT(error_of([&] { make_tokenizer(dir.path().string()); }), HasSubstr("tokenizer_config.json': /bos_token is 5, not a string. Fix the file."));
  test::write_file(dir / "tokenizer_config.json", R"({"bos_token": "<|eot|>", "eos_token": {"content": "<nope>"}})");
  EXPECT_THAT(error_of([&] { make_tokenizer(dir.path().string()); }),
              HasSubstr("tokenizer_config.json': its eos_token \"<nope>\" is not a token of"));
}

// ByteTokenizer with an EOS id after the bytes, to see documents joined.
class EosByteTokenizer : public Tokenizer {
 public:
  Ids encode(std::string_view text) const override { return bytes_.encode(text); }
  std::string decode(std::span<const std::int64_t> ids) const override { return bytes_.decode(ids); }
  std::int64_t vocab_size() const override { return 257; }
  std::optional<std::int64_t> bos_id() const override { return std::nullopt; }
  std::optional<std::int64_t> eos_id() const override { return 256; }

 private:
  ByteTokenizer bytes_;
};

std::string corpus() {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "line " + std::to_string(i) + ": the quick brown fox\n";
  return text;
}

TextDatasetOptions options(const fs::path& file, std::int64_t batch, std::int64_t seq, std::uint64_t seed, int rank = 0, int world = 1) {
  return {{file.string()}, batch, seq, seed, rank, world};
}

TEST(TextDataset, BatchesAreWindowsOfTheStreamWithShiftedLabels) {
  test::TempDir dir;
  const std::string text = corpus();
  test::write_file(dir / "c.txt", text);
  ByteTokenizer tok;
  TextDataset data(options(dir / "c.txt", 4, 16, 7), tok);
  // One document: BOS, its bytes, EOS. Below, `stream` is that as text (BOS and EOS as \x01, \x02).
  Ids expected = {256};
  for (unsigned char c : text) expected.push_back(c);
  expected.push_back(257);
  EXPECT_EQ(data.stream(), expected);
  std::string stream;
  for (std::int64_t id : data.stream()) stream += static_cast<char>(id == 256 ? 1 : id == 257 ? 2 : id);
  const auto as_text = [](Ids::const_iterator begin, Ids::const_iterator end) {
    std::string out;
    for (auto it = begin; it != end; ++it) out += static_cast<char>(*it == 256 ? 1 : *it == 257 ? 2 : *it);
    return out;
  };
  for (int step = 0; step < 3; ++step) {
    const Batch b = data.next_batch();
    ASSERT_EQ(b.rows, 4);
    ASSERT_EQ(b.seq_len, 16);
    ASSERT_EQ(b.tokens.size(), 64u);
    ASSERT_EQ(b.labels.size(), 64u);
    for (std::int64_t r = 0; r < 4; ++r) {
      const std::int64_t start = data.sample_start(static_cast<std::uint64_t>(step * 4 + r));
      ASSERT_GE(start, 0);
      ASSERT_LE(start + 16, static_cast<std::int64_t>(stream.size()) - 1);
      const auto row = [&](const Ids& v) { return as_text(v.begin() + r * 16, v.begin() + (r + 1) * 16); };
      EXPECT_EQ(row(b.tokens), stream.substr(static_cast<std::size_t>(start), 16));
      EXPECT_EQ(row(b.labels), stream.substr(static_cast<std::size_t>(start) + 1, 16));
    }
  }
  EXPECT_EQ(data.state().samples, 12u);
}

TEST(TextDataset, PositionsAreFixedBySeedAndSampleIndex) {
  test::TempDir dir;
  test::write_file(dir / "c.txt", corpus());
  ByteTokenizer tok;
  TextDataset a(options(dir / "c.txt", 4, 32, 1234), tok), b(options(dir / "c.txt", 4, 32, 1234), tok);
  TextDataset other(options(dir / "c.txt", 4, 32, 1235), tok);
  for (int step = 0; step < 3; ++step) {
    const Batch x = a.next_batch(), y = b.next_batch(), z = other.next_batch();
    EXPECT_EQ(x.tokens, y.tokens);
    EXPECT_EQ(x.labels, y.labels);
    EXPECT_NE(x.tokens, z.tokens);
  }
  // splitmix64 values, computed independently (Python): the same on every platform. The
  // stream is the file's 5890 bytes between BOS and EOS.
  EXPECT_EQ(a.stream().size(), 5892u);
  EXPECT_EQ((Ids{a.sample_start(0), a.sample_start(1), a.sample_start(2), a.sample_start(1000000)}),
            (Ids{3618, 5076, 427, 4697}));
}

TEST(TextDataset, RankSlicesConcatenateToTheGlobalBatch) {
  test::TempDir dir;
  test::write_file(dir / "c.txt", corpus());
  ByteTokenizer tok;
  TextDataset global(options(dir / "c.txt", 6, 8, 3), tok);
  std::vector<Batch> steps = {global.next_batch(), global.next_batch()};
  for (int world = 2; world <= 6; ++world) {
    std::vector<TextDataset> ranks;
    for (int r = 0; r < world; ++r) ranks.emplace_back(options(dir / "c.txt", 6, 8, 3, r, world), tok);
    for (const Batch& expected : steps) {
      Ids tokens, labels;
      std::int64_t rows = 0;
      for (int r = 0; r < world; ++r) {
        const Batch b = ranks[static_cast<std::size_t>(r)].next_batch();
        EXPECT_EQ(b.rows, (r + 1) * 6 / world - r * 6 / world);
        rows += b.rows;
        tokens.insert(tokens.end(), b.tokens.begin(), b.tokens.end());
        labels.insert(labels.end(), b.labels.begin(), b.labels.end());
      }
      EXPECT_EQ(rows, 6);
      EXPECT_EQ(tokens, expected.tokens) << "world size " << world;
      EXPECT_EQ(labels, expected.labels) << "world size " << world;
    }
  }
}

TEST(TextDataset, RestoredStateContinuesWhereItWas) {
  test::TempDir dir;
  test::write_file(dir / "c.txt", corpus());
  ByteTokenizer tok;
  TextDataset a(options(dir / "c.txt", 4, 16, 9), tok);
  a.next_batch();
  a.next_batch();
  const TextDatasetState saved = a.state();
  EXPECT_EQ(saved.samples, 8u);
  const Batch third = a.next_batch();
  // A fresh data set on two ranks, restored from the one-rank run.
  Ids tokens;
  for (int r = 0; r < 2; ++r) {
    TextDataset b(options(dir / "c.txt", 4, 16, 9, r, 2), tok);
    b.restore(saved);
    const Batch half = b.next_batch();
    tokens.insert(tokens.end(), half.tokens.begin(), half.tokens.end());
    EXPECT_EQ(b.state().samples, 12u);
  }
  EXPECT_EQ(tokens, third.tokens);
}

TEST(TextDataset, JsonLinesDocumentsAreJoinedWithEos) {
  test::TempDir dir;
  test::write_file(dir / "d.jsonl", "{\"text\": \"ab\"}\n\n{\"text\": \"c\\u00e9\", \"id\": 2}\n{\"text\": \"\"}\n");
  test::write_file(dir / "sniffed.data", "{\"text\": \"xy\"}\n");
  test::write_file(dir / "plain.txt", "{\"text\": \"xy\"}\n");
  EosByteTokenizer tok;
  TextDataset data({{(dir / "d.jsonl").string(), (dir / "sniffed.data").string(), (dir / "plain.txt").string()}, 1, 4, 0}, tok);
  Ids expected = {'a', 'b', 256, 'c', 0xC3, 0xA9, 256, 'x', 'y', 256};
  for (unsigned char c : std::string("{\"text\": \"xy\"}\n")) expected.push_back(c);
  expected.push_back(256);
  EXPECT_EQ(data.stream(), expected);
}

// data.document_separator cuts a plain text file into documents (as Python's str.split), each
// between BOS and EOS; empty pieces are skipped; JSON Lines records are not cut.
TEST(TextDataset, SeparatorSplitsTextFilesIntoDocuments) {
  test::TempDir dir;
  test::write_file(dir / "fortunes", "one\n%\ntwo\n%\n%\nthree\n%\n");  // as /usr/share/games/fortunes/*
  test::write_file(dir / "r.jsonl", "{\"text\": \"a%\\nb\"}\n");
  ByteTokenizer tok;
  auto stream_of = [&](const std::string& separator) {
    TextDatasetOptions o{{(dir / "fortunes").string(), (dir / "r.jsonl").string()}, 1, 2, 0};
    o.document_separator = separator;
    return TextDataset(o, tok).stream();
  };
  auto doc = [](const std::string& text) {
    Ids ids = {256};
    for (unsigned char c : text) ids.push_back(c);
    ids.push_back(257);
    return ids;
  };
  auto join = [](std::initializer_list<Ids> docs) {
    Ids all;
    for (const Ids& d : docs) all.insert(all.end(), d.begin(), d.end());
    return all;
  };
  EXPECT_EQ(stream_of("%\n"), join({doc("one\n"), doc("two\n"), doc("three\n"), doc("a%\nb")}));
  EXPECT_EQ(stream_of(""), join({doc("one\n%\ntwo\n%\n%\nthree\n%\n"), doc("a%\nb")}));  // a file is one document
  EXPECT_EQ(stream_of("\n%\n"), join({doc("one"), doc("two"), doc("%\nthree"), doc("a%\nb")}));
  EXPECT_EQ(stream_of("nothing like it"), stream_of(""));
}

// A tokenizer.json like Llama 3's: the post-processor's template adds BOS (or BOS and EOS, or
// nothing), tokenizer_config.json names both. Each document of a two-record JSON Lines file
// gets exactly the ids of torchtitan's encode(text, add_bos=True, add_eos=True) on the
// `tokenizers` library, run here: its post-processor's ids, BOS in front and EOS after unless
// the post-processor adds them already. So EOS stands between the documents.
TEST(TextDataset, JsonLinesDocumentsGetTheIdsOfTokenizersWithItsPostProcessor) {
  if (!reference_missing().empty()) GTEST_SKIP() << reference_missing();
  test::TempDir dir;
  test::write_file(dir / "docs.jsonl", "{\"text\": \"the weather in the north\"}\n\n{\"text\": \"abc 123 h\\u00e9llo\\n\"}\n");
  test::write_file(dir / "ref.py",
                   "import json, sys\n"
                   "from tokenizers import Tokenizer\n"
                   "t = Tokenizer.from_file(sys.argv[1])\n"
                   "cfg = json.load(open(sys.argv[2], encoding='utf-8'))\n"
                   "name = lambda v: v['content'] if isinstance(v, dict) else v  # as torchtitan's _get_token_from_config\n"
                   "bos, eos = t.token_to_id(name(cfg['bos_token'])), t.token_to_id(name(cfg['eos_token']))\n"
                   "own = t.encode('').ids  # what the post-processor adds by itself (torchtitan's hf_adds_bos/eos)\n"
                   "ids = []\n"
                   "for line in open(sys.argv[3], encoding='utf-8'):\n"
                   "    if not line.strip(): continue\n"
                   "    doc = t.encode(json.loads(line)['text'], add_special_tokens=True).ids\n"
                   "    ids += ([] if bos in own else [bos]) + doc + ([] if eos in own else [eos])\n"
                   "json.dump(ids, open(sys.argv[4], 'w'))\n");
  const json bos_item = {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}};
  const json eos_item = {{"SpecialToken", {{"id", "<|end_of_text|>"}, {"type_id", 0}}}};
  const json text_item = {{"Sequence", {{"id", "A"}, {"type_id", 0}}}};
  const std::vector<std::pair<std::string, json>> singles = {
      {"bos", json::array({bos_item, text_item})},  // Llama 3's
      {"bos_eos", json::array({bos_item, text_item, eos_item})},
      {"none", json()}};
  for (const auto& [name, single] : singles) {
    const fs::path folder = dir / name;
    fs::create_directories(folder);
    json t = byte_level_bpe(false);
    t["added_tokens"] = {added("<|begin_of_text|>", true), added("<|end_of_text|>", true)};  // ids 276, 277
    t["post_processor"] = single.is_null() ? json()
                                           : json{{"type", "TemplateProcessing"},
                                                  {"single", single},
                                                  {"pair", json::array({text_item})},
                                                  {"special_tokens",
                                                   {{"<|begin_of_text|>", {{"id", "<|begin_of_text|>"}, {"ids", {276}}, {"tokens", {"<|begin_of_text|>"}}}},
                                                    {"<|end_of_text|>", {{"id", "<|end_of_text|>"}, {"ids", {277}}, {"tokens", {"<|end_of_text|>"}}}}}}};
    test::write_file(folder / "tokenizer.json", t.dump());
    test::write_file(folder / "tokenizer_config.json", R"({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|end_of_text|>"}})");
    const auto run = test::run_command("'" + kPython.string() + "' " + (dir / "ref.py").string() + " '" + (folder / "tokenizer.json").string() +
                                       "' '" + (folder / "tokenizer_config.json").string() + "' " + (dir / "docs.jsonl").string() + " " +
                                       (folder / "ref.json").string());
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const Ids expected = json::parse(read(folder / "ref.json")).get<Ids>();

    const auto tok = make_tokenizer(folder.string());
    ASSERT_EQ(tok->bos_id(), 276);
    ASSERT_EQ(tok->eos_id(), 277);
    const TextDataset data({{(dir / "docs.jsonl").string()}, 1, 4, 0}, *tok);
    EXPECT_EQ(data.stream(), expected) << name;
    // Whatever the template: BOS doc EOS BOS doc EOS, each once per document.
    ASSERT_GE(expected.size(), 6u) << name;
    EXPECT_EQ(expected.front(), 276) << name;
    EXPECT_EQ(expected.back(), 277) << name;
    EXPECT_EQ(std::count(expected.begin(), expected.end(), 276), 2) << name;
    EXPECT_EQ(std::count(expected.begin(), expected.end(), 277), 2) << name;
    const auto second = std::find(expected.begin() + 1, expected.end(), 276);
    ASSERT_NE(second, expected.end());
    EXPECT_EQ(*(second - 1), 277) << name << ": EOS between the documents";
  }
}

TEST(TextDataset, ErrorsNameTheFileAndWhatToDo) {
  test::TempDir dir;
  ByteTokenizer tok;
  const fs::path missing = dir / "missing.txt";
  EXPECT_THAT(error_of([&] { TextDataset(options(missing, 1, 4, 0), tok); }),
              HasSubstr("'" + missing.string() + "' does not exist"));
  test::write_file(dir / "empty.txt", "");
  EXPECT_THAT(error_of([&] { TextDataset(options(dir / "empty.txt", 1, 4, 0), tok); }),
              HasSubstr("empty.txt' holds no text (0 tokens)"));
  test::write_file(dir / "bad.jsonl", "{\"text\": \"a\"}\n{\"body\": \"b\"}\n");
  EXPECT_THAT(error_of([&] { TextDataset(options(dir / "bad.jsonl", 1, 4, 0), tok); }),
              HasSubstr("bad.jsonl' line 2 has no \"text\" field"));
  test::write_file(dir / "broken.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \n");
  EXPECT_THAT(error_of([&] { TextDataset(options(dir / "broken.jsonl", 1, 4, 0), tok); }),
              HasSubstr("broken.jsonl' line 3 is not valid JSON"));
  test::write_file(dir / "short.txt", "0123456789");  // BOS, 10 bytes, EOS
  EXPECT_THAT(error_of([&] { TextDataset(options(dir / "short.txt", 1, 12, 0), tok); }),
              HasSubstr("short.txt' holds 12 tokens, but a sample needs seq_len + 1 = 13"));
  EXPECT_NO_THROW(TextDataset(options(dir / "short.txt", 1, 11, 0), tok));
  EXPECT_THAT(error_of([&] { TextDataset(options(dir / "short.txt", 4, 2, 0, 4, 4), tok); }),
              HasSubstr("rank 4 of world size 4"));
  EXPECT_THAT(error_of([&] { TextDataset(options(dir / "short.txt", 2, 2, 0, 0, 4), tok); }),
              HasSubstr("need 0 <= rank < world_size <= batch_size"));
}

TEST(TextDataset, TokenizesTinyShakespeareWithTheHuggingFaceTokenizer) {
  if (!fs::exists(kSharedData / "tokenizer.json")) GTEST_SKIP() << "no " << kSharedData << " (shared data not on this machine)";
  const auto tok = make_tokenizer((kSharedData / "tokenizer.json").string());
  TextDataset data({{(kSharedData / "tinyshakespeare.txt").string()}, 8, 2048, 42, 1, 2}, *tok);
  // Its post-processor (ByteLevel) adds nothing: BOS and EOS come from tokenizer_config.json.
  EXPECT_EQ(data.stream().front(), 2002);  // the document begins with BOS
  EXPECT_EQ(data.stream().back(), 2003);   // and ends with EOS
  EXPECT_EQ(std::count(data.stream().begin(), data.stream().end(), 2002), 1);
  const Batch b = data.next_batch();
  EXPECT_EQ(b.rows, 4);
  EXPECT_EQ(b.tokens.size(), 4u * 2048);
  for (std::int64_t id : b.tokens) ASSERT_LT(id, tok->vocab_size());
}

}  // namespace
}  // namespace spmdx::data
