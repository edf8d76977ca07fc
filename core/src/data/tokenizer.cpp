#include "spmdx/data/tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <queue>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/text.h"
#include "../json_at.h"

namespace spmdx::data {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// ---- Unicode: UTF-8 and the character classes of the GPT-2 pattern.

constexpr char32_t kInvalid = 0xFFFFFFFF;

struct Char {
  char32_t cp;       // kInvalid for an invalid sequence
  std::size_t size;  // bytes; for an invalid sequence its maximal valid prefix, at least 1
};

// The character at s[i]. Invalid sequences are cut as Unicode's "maximal subparts" (what Rust's
// String::from_utf8_lossy replaces with one U+FFFD each).
Char next_char(std::string_view s, std::size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {b0, 1};
  std::size_t size = 0;
  char32_t cp = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    size = 2, cp = b0 & 0x1Fu;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    size = 3, cp = b0 & 0x0Fu;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    size = 4, cp = b0 & 0x07u;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {kInvalid, 1};
  }
  for (std::size_t k = 1; k < size; ++k) {
    if (i + k >= s.size()) return {kInvalid, k};
    const auto b = static_cast<unsigned char>(s[i + k]);
    if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return {kInvalid, k};
    cp = (cp << 6) | (b & 0x3Fu);
  }
  return {cp, size};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// Invalid sequences become U+FFFD, as Rust's String::from_utf8_lossy.
std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size();) {
    const Char c = next_char(bytes, i);
    if (c.cp == kInvalid) {
      out += "\xEF\xBF\xBD";
    } else {
      out.append(bytes.substr(i, c.size));
    }
    i += c.size;
  }
  return out;
}

// The start of the character that ends at s[end], for end > 0.
std::size_t char_start_before(std::string_view s, std::size_t end) {
  std::size_t start = end - 1;
  while (start > 0 && end - start < 4 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_char(s, start).size == end - start ? start : end - 1;
}

struct CodeRange {
  char32_t first, last;
};

bool in_ranges(char32_t cp, std::span<const CodeRange> ranges) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), cp, [](char32_t c, const CodeRange& r) { return c < r.first; });
  return it != ranges.begin() && cp <= std::prev(it)->last;
}

// \p{L} and \p{N} as the Oniguruma in `tokenizers` 0.23 matches them (Unicode 16): the ranges
// were read off that library by matching every code point, so that both split text alike.
constexpr CodeRange kLetters[] = {
    {0x41, 0x5A}, {0x61, 0x7A}, {0xAA, 0xAA}, {0xB5, 0xB5}, {0xBA, 0xBA}, {0xC0, 0xD6}, {0xD8, 0xF6}, {0xF8, 0x2C1},
    {0x2C6, 0x2D1}, {0x2E0, 0x2E4}, {0x2EC, 0x2EC}, {0x2EE, 0x2EE}, {0x370, 0x374}, {0x376, 0x377}, {0x37A, 0x37D},
    {0x37F, 0x37F}, {0x386, 0x386}, {0x388, 0x38A}, {0x38C, 0x38C}, {0x38E, 0x3A1}, {0x3A3, 0x3F5}, {0x3F7, 0x481},
    {0x48A, 0x52F}, {0x531, 0x556}, {0x559, 0x559}, {0x560, 0x588}, {0x5D0, 0x5EA}, {0x5EF, 0x5F2}, {0x620, 0x64A},
    {0x66E, 0x66F}, {0x671, 0x6D3}, {0x6D5, 0x6D5}, {0x6E5, 0x6E6}, {0x6EE, 0x6EF}, {0x6FA, 0x6FC}, {0x6FF, 0x6FF},
    {0x710, 0x710}, {0x712, 0x72F}, {0x74D, 0x7A5}, {0x7B1, 0x7B1}, {0x7CA, 0x7EA}, {0x7F4, 0x7F5}, {0x7FA, 0x7FA},
    {0x800, 0x815}, {0x81A, 0x81A}, {0x824, 0x824}, {0x828, 0x828}, {0x840, 0x858}, {0x860, 0x86A}, {0x870, 0x887},
    {0x889, 0x88E}, {0x8A0, 0x8C9}, {0x904, 0x939}, {0x93D, 0x93D}, {0x950, 0x950}, {0x958, 0x961}, {0x971, 0x980},
    {0x985, 0x98C}, {0x98F, 0x990}, {0x993, 0x9A8}, {0x9AA, 0x9B0}, {0x9B2, 0x9B2}, {0x9B6, 0x9B9}, {0x9BD, 0x9BD},
    {0x9CE, 0x9CE}, {0x9DC, 0x9DD}, {0x9DF, 0x9E1}, {0x9F0, 0x9F1}, {0x9FC, 0x9FC}, {0xA05, 0xA0A}, {0xA0F, 0xA10},
    {0xA13, 0xA28}, {0xA2A, 0xA30}, {0xA32, 0xA33}, {0xA35, 0xA36}, {0xA38, 0xA39}, {0xA59, 0xA5C}, {0xA5E, 0xA5E},
    {0xA72, 0xA74}, {0xA85, 0xA8D}, {0xA8F, 0xA91}, {0xA93, 0xAA8}, {0xAAA, 0xAB0}, {0xAB2, 0xAB3}, {0xAB5, 0xAB9},
    {0xABD, 0xABD}, {0xAD0, 0xAD0}, {0xAE0, 0xAE1}, {0xAF9, 0xAF9}, {0xB05, 0xB0C}, {0xB0F, 0xB10}, {0xB13, 0xB28},
    {0xB2A, 0xB30}, {0xB32, 0xB33}, {0xB35, 0xB39}, {0xB3D, 0xB3D}, {0xB5C, 0xB5D}, {0xB5F, 0xB61}, {0xB71, 0xB71},
    {0xB83, 0xB83}, {0xB85, 0xB8A}, {0xB8E, 0xB90}, {0xB92, 0xB95}, {0xB99, 0xB9A}, {0xB9C, 0xB9C}, {0xB9E, 0xB9F},
    {0xBA3, 0xBA4}, {0xBA8, 0xBAA}, {0xBAE, 0xBB9}, {0xBD0, 0xBD0}, {0xC05, 0xC0C}, {0xC0E, 0xC10}, {0xC12, 0xC28},
    {0xC2A, 0xC39}, {0xC3D, 0xC3D}, {0xC58, 0xC5A}, {0xC5D, 0xC5D}, {0xC60, 0xC61}, {0xC80, 0xC80}, {0xC85, 0xC8C},
    {0xC8E, 0xC90}, {0xC92, 0xCA8}, {0xCAA, 0xCB3}, {0xCB5, 0xCB9}, {0xCBD, 0xCBD}, {0xCDD, 0xCDE}, {0xCE0, 0xCE1},
    {0xCF1, 0xCF2}, {0xD04, 0xD0C}, {0xD0E, 0xD10}, {0xD12, 0xD3A}, {0xD3D, 0xD3D}, {0xD4E, 0xD4E}, {0xD54, 0xD56},
    {0xD5F, 0xD61}, {0xD7A, 0xD7F}, {0xD85, 0xD96}, {0xD9A, 0xDB1}, {0xDB3, 0xDBB}, {0xDBD, 0xDBD}, {0xDC0, 0xDC6},
    {0xE01, 0xE30}, {0xE32, 0xE33}, {0xE40, 0xE46}, {0xE81, 0xE82}, {0xE84, 0xE84}, {0xE86, 0xE8A}, {0xE8C, 0xEA3},
    {0xEA5, 0xEA5}, {0xEA7, 0xEB0}, {0xEB2, 0xEB3}, {0xEBD, 0xEBD}, {0xEC0, 0xEC4}, {0xEC6, 0xEC6}, {0xEDC, 0xEDF},
    {0xF00, 0xF00}, {0xF40, 0xF47}, {0xF49, 0xF6C}, {0xF88, 0xF8C}, {0x1000, 0x102A}, {0x103F, 0x103F},
    {0x1050, 0x1055}, {0x105A, 0x105D}, {0x1061, 0x1061}, {0x1065, 0x1066}, {0x106E, 0x1070}, {0x1075, 0x1081},
    {0x108E, 0x108E}, {0x10A0, 0x10C5}, {0x10C7, 0x10C7}, {0x10CD, 0x10CD}, {0x10D0, 0x10FA}, {0x10FC, 0x1248},
    {0x124A, 0x124D}, {0x1250, 0x1256}, {0x1258, 0x1258}, {0x125A, 0x125D}, {0x1260, 0x1288}, {0x128A, 0x128D},
    {0x1290, 0x12B0}, {0x12B2, 0x12B5}, {0x12B8, 0x12BE}, {0x12C0, 0x12C0}, {0x12C2, 0x12C5}, {0x12C8, 0x12D6},
    {0x12D8, 0x1310}, {0x1312, 0x1315}, {0x1318, 0x135A}, {0x1380, 0x138F}, {0x13A0, 0x13F5}, {0x13F8, 0x13FD},
    {0x1401, 0x166C}, {0x166F, 0x167F}, {0x1681, 0x169A}, {0x16A0, 0x16EA}, {0x16F1, 0x16F8}, {0x1700, 0x1711},
    {0x171F, 0x1731}, {0x1740, 0x1751}, {0x1760, 0x176C}, {0x176E, 0x1770}, {0x1780, 0x17B3}, {0x17D7, 0x17D7},
    {0x17DC, 0x17DC}, {0x1820, 0x1878}, {0x1880, 0x1884}, {0x1887, 0x18A8}, {0x18AA, 0x18AA}, {0x18B0, 0x18F5},
    {0x1900, 0x191E}, {0x1950, 0x196D}, {0x1970, 0x1974}, {0x1980, 0x19AB}, {0x19B0, 0x19C9}, {0x1A00, 0x1A16},
    {0x1A20, 0x1A54}, {0x1AA7, 0x1AA7}, {0x1B05, 0x1B33}, {0x1B45, 0x1B4C}, {0x1B83, 0x1BA0}, {0x1BAE, 0x1BAF},
    {0x1BBA, 0x1BE5}, {0x1C00, 0x1C23}, {0x1C4D, 0x1C4F}, {0x1C5A, 0x1C7D}, {0x1C80, 0x1C8A}, {0x1C90, 0x1CBA},
    {0x1CBD, 0x1CBF}, {0x1CE9, 0x1CEC}, {0x1CEE, 0x1CF3}, {0x1CF5, 0x1CF6}, {0x1CFA, 0x1CFA}, {0x1D00, 0x1DBF},
    {0x1E00, 0x1F15}, {0x1F18, 0x1F1D}, {0x1F20, 0x1F45}, {0x1F48, 0x1F4D}, {0x1F50, 0x1F57}, {0x1F59, 0x1F59},
    {0x1F5B, 0x1F5B}, {0x1F5D, 0x1F5D}, {0x1F5F, 0x1F7D}, {0x1F80, 0x1FB4}, {0x1FB6, 0x1FBC}, {0x1FBE, 0x1FBE},
    {0x1FC2, 0x1FC4}, {0x1FC6, 0x1FCC}, {0x1FD0, 0x1FD3}, {0x1FD6, 0x1FDB}, {0x1FE0, 0x1FEC}, {0x1FF2, 0x1FF4},
    {0x1FF6, 0x1FFC}, {0x2071, 0x2071}, {0x207F, 0x207F}, {0x2090, 0x209C}, {0x2102, 0x2102}, {0x2107, 0x2107},
    {0x210A, 0x2113}, {0x2115, 0x2115}, {0x2119, 0x211D}, {0x2124, 0x2124}, {0x2126, 0x2126}, {0x2128, 0x2128},
    {0x212A, 0x212D}, {0x212F, 0x2139}, {0x213C, 0x213F}, {0x2145, 0x2149}, {0x214E, 0x214E}, {0x2183, 0x2184},
    {0x2C00, 0x2CE4}, {0x2CEB, 0x2CEE}, {0x2CF2, 0x2CF3}, {0x2D00, 0x2D25}, {0x2D27, 0x2D27}, {0x2D2D, 0x2D2D},
    {0x2D30, 0x2D67}, {0x2D6F, 0x2D6F}, {0x2D80, 0x2D96}, {0x2DA0, 0x2DA6}, {0x2DA8, 0x2DAE}, {0x2DB0, 0x2DB6},
    {0x2DB8, 0x2DBE}, {0x2DC0, 0x2DC6}, {0x2DC8, 0x2DCE}, {0x2DD0, 0x2DD6}, {0x2DD8, 0x2DDE}, {0x2E2F, 0x2E2F},
    {0x3005, 0x3006}, {0x3031, 0x3035}, {0x303B, 0x303C}, {0x3041, 0x3096}, {0x309D, 0x309F}, {0x30A1, 0x30FA},
    {0x30FC, 0x30FF}, {0x3105, 0x312F}, {0x3131, 0x318E}, {0x31A0, 0x31BF}, {0x31F0, 0x31FF}, {0x3400, 0x4DBF},
    {0x4E00, 0xA48C}, {0xA4D0, 0xA4FD}, {0xA500, 0xA60C}, {0xA610, 0xA61F}, {0xA62A, 0xA62B}, {0xA640, 0xA66E},
    {0xA67F, 0xA69D}, {0xA6A0, 0xA6E5}, {0xA717, 0xA71F}, {0xA722, 0xA788}, {0xA78B, 0xA7CD}, {0xA7D0, 0xA7D1},
    {0xA7D3, 0xA7D3}, {0xA7D5, 0xA7DC}, {0xA7F2, 0xA801}, {0xA803, 0xA805}, {0xA807, 0xA80A}, {0xA80C, 0xA822},
    {0xA840, 0xA873}, {0xA882, 0xA8B3}, {0xA8F2, 0xA8F7}, {0xA8FB, 0xA8FB}, {0xA8FD, 0xA8FE}, {0xA90A, 0xA925},
    {0xA930, 0xA946}, {0xA960, 0xA97C}, {0xA984, 0xA9B2}, {0xA9CF, 0xA9CF}, {0xA9E0, 0xA9E4}, {0xA9E6, 0xA9EF},
    {0xA9FA, 0xA9FE}, {0xAA00, 0xAA28}, {0xAA40, 0xAA42}, {0xAA44, 0xAA4B}, {0xAA60, 0xAA76}, {0xAA7A, 0xAA7A},
    {0xAA7E, 0xAAAF}, {0xAAB1, 0xAAB1}, {0xAAB5, 0xAAB6}, {0xAAB9, 0xAABD}, {0xAAC0, 0xAAC0}, {0xAAC2, 0xAAC2},
    {0xAADB, 0xAADD}, {0xAAE0, 0xAAEA}, {0xAAF2, 0xAAF4}, {0xAB01, 0xAB06}, {0xAB09, 0xAB0E}, {0xAB11, 0xAB16},
    {0xAB20, 0xAB26}, {0xAB28, 0xAB2E}, {0xAB30, 0xAB5A}, {0xAB5C, 0xAB69}, {0xAB70, 0xABE2}, {0xAC00, 0xD7A3},
    {0xD7B0, 0xD7C6}, {0xD7CB, 0xD7FB}, {0xF900, 0xFA6D}, {0xFA70, 0xFAD9}, {0xFB00, 0xFB06}, {0xFB13, 0xFB17},
    {0xFB1D, 0xFB1D}, {0xFB1F, 0xFB28}, {0xFB2A, 0xFB36}, {0xFB38, 0xFB3C}, {0xFB3E, 0xFB3E}, {0xFB40, 0xFB41},
    {0xFB43, 0xFB44}, {0xFB46, 0xFBB1}, {0xFBD3, 0xFD3D}, {0xFD50, 0xFD8F}, {0xFD92, 0xFDC7}, {0xFDF0, 0xFDFB},
    {0xFE70, 0xFE74}, {0xFE76, 0xFEFC}, {0xFF21, 0xFF3A}, {0xFF41, 0xFF5A}, {0xFF66, 0xFFBE}, {0xFFC2, 0xFFC7},
    {0xFFCA, 0xFFCF}, {0xFFD2, 0xFFD7}, {0xFFDA, 0xFFDC}, {0x10000, 0x1000B}, {0x1000D, 0x10026}, {0x10028, 0x1003A},
    {0x1003C, 0x1003D}, {0x1003F, 0x1004D}, {0x10050, 0x1005D}, {0x10080, 0x100FA}, {0x10280, 0x1029C},
    {0x102A0, 0x102D0}, {0x10300, 0x1031F}, {0x1032D, 0x10340}, {0x10342, 0x10349}, {0x10350, 0x10375},
    {0x10380, 0x1039D}, {0x103A0, 0x103C3}, {0x103C8, 0x103CF}, {0x10400, 0x1049D}, {0x104B0, 0x104D3},
    {0x104D8, 0x104FB}, {0x10500, 0x10527}, {0x10530, 0x10563}, {0x10570, 0x1057A}, {0x1057C, 0x1058A},
    {0x1058C, 0x10592}, {0x10594, 0x10595}, {0x10597, 0x105A1}, {0x105A3, 0x105B1}, {0x105B3, 0x105B9},
    {0x105BB, 0x105BC}, {0x105C0, 0x105F3}, {0x10600, 0x10736}, {0x10740, 0x10755}, {0x10760, 0x10767},
    {0x10780, 0x10785}, {0x10787, 0x107B0}, {0x107B2, 0x107BA}, {0x10800, 0x10805}, {0x10808, 0x10808},
    {0x1080A, 0x10835}, {0x10837, 0x10838}, {0x1083C, 0x1083C}, {0x1083F, 0x10855}, {0x10860, 0x10876},
    {0x10880, 0x1089E}, {0x108E0, 0x108F2}, {0x108F4, 0x108F5}, {0x10900, 0x10915}, {0x10920, 0x10939},
    {0x10980, 0x109B7}, {0x109BE, 0x109BF}, {0x10A00, 0x10A00}, {0x10A10, 0x10A13}, {0x10A15, 0x10A17},
    {0x10A19, 0x10A35}, {0x10A60, 0x10A7C}, {0x10A80, 0x10A9C}, {0x10AC0, 0x10AC7}, {0x10AC9, 0x10AE4},
    {0x10B00, 0x10B35}, {0x10B40, 0x10B55}, {0x10B60, 0x10B72}, {0x10B80, 0x10B91}, {0x10C00, 0x10C48},
    {0x10C80, 0x10CB2}, {0x10CC0, 0x10CF2}, {0x10D00, 0x10D23}, {0x10D4A, 0x10D65}, {0x10D6F, 0x10D85},
    {0x10E80, 0x10EA9}, {0x10EB0, 0x10EB1}, {0x10EC2, 0x10EC4}, {0x10F00, 0x10F1C}, {0x10F27, 0x10F27},
    {0x10F30, 0x10F45}, {0x10F70, 0x10F81}, {0x10FB0, 0x10FC4}, {0x10FE0, 0x10FF6}, {0x11003, 0x11037},
    {0x11071, 0x11072}, {0x11075, 0x11075}, {0x11083, 0x110AF}, {0x110D0, 0x110E8}, {0x11103, 0x11126},
    {0x11144, 0x11144}, {0x11147, 0x11147}, {0x11150, 0x11172}, {0x11176, 0x11176}, {0x11183, 0x111B2},
    {0x111C1, 0x111C4}, {0x111DA, 0x111DA}, {0x111DC, 0x111DC}, {0x11200, 0x11211}, {0x11213, 0x1122B},
    {0x1123F, 0x11240}, {0x11280, 0x11286}, {0x11288, 0x11288}, {0x1128A, 0x1128D}, {0x1128F, 0x1129D},
    {0x1129F, 0x112A8}, {0x112B0, 0x112DE}, {0x11305, 0x1130C}, {0x1130F, 0x11310}, {0x11313, 0x11328},
    {0x1132A, 0x11330}, {0x11332, 0x11333}, {0x11335, 0x11339}, {0x1133D, 0x1133D}, {0x11350, 0x11350},
    {0x1135D, 0x11361}, {0x11380, 0x11389}, {0x1138B, 0x1138B}, {0x1138E, 0x1138E}, {0x11390, 0x113B5},
    {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11400, 0x11434}, {0x11447, 0x1144A},
    {0x1145F, 0x11461}, {0x11480, 0x114AF}, {0x114C4, 0x114C5}, {0x114C7, 0x114C7}, {0x11580, 0x115AE},
    {0x115D8, 0x115DB}, {0x11600, 0x1162F}, {0x11644, 0x11644}, {0x11680, 0x116AA}, {0x116B8, 0x116B8},
    {0x11700, 0x1171A}, {0x11740, 0x11746}, {0x11800, 0x1182B}, {0x118A0, 0x118DF}, {0x118FF, 0x11906},
    {0x11909, 0x11909}, {0x1190C, 0x11913}, {0x11915, 0x11916}, {0x11918, 0x1192F}, {0x1193F, 0x1193F},
    {0x11941, 0x11941}, {0x119A0, 0x119A7}, {0x119AA, 0x119D0}, {0x119E1, 0x119E1}, {0x119E3, 0x119E3},
    {0x11A00, 0x11A00}, {0x11A0B, 0x11A32}, {0x11A3A, 0x11A3A}, {0x11A50, 0x11A50}, {0x11A5C, 0x11A89},
    {0x11A9D, 0x11A9D}, {0x11AB0, 0x11AF8}, {0x11BC0, 0x11BE0}, {0x11C00, 0x11C08}, {0x11C0A, 0x11C2E},
    {0x11C40, 0x11C40}, {0x11C72, 0x11C8F}, {0x11D00, 0x11D06}, {0x11D08, 0x11D09}, {0x11D0B, 0x11D30},
    {0x11D46, 0x11D46}, {0x11D60, 0x11D65}, {0x11D67, 0x11D68}, {0x11D6A, 0x11D89}, {0x11D98, 0x11D98},
    {0x11EE0, 0x11EF2}, {0x11F02, 0x11F02}, {0x11F04, 0x11F10}, {0x11F12, 0x11F33}, {0x11FB0, 0x11FB0},
    {0x12000, 0x12399}, {0x12480, 0x12543}, {0x12F90, 0x12FF0}, {0x13000, 0x1342F}, {0x13441, 0x13446},
    {0x13460, 0x143FA}, {0x14400, 0x14646}, {0x16100, 0x1611D}, {0x16800, 0x16A38}, {0x16A40, 0x16A5E},
    {0x16A70, 0x16ABE}, {0x16AD0, 0x16AED}, {0x16B00, 0x16B2F}, {0x16B40, 0x16B43}, {0x16B63, 0x16B77},
    {0x16B7D, 0x16B8F}, {0x16D40, 0x16D6C}, {0x16E40, 0x16E7F}, {0x16F00, 0x16F4A}, {0x16F50, 0x16F50},
    {0x16F93, 0x16F9F}, {0x16FE0, 0x16FE1}, {0x16FE3, 0x16FE3}, {0x17000, 0x187F7}, {0x18800, 0x18CD5},
    {0x18CFF, 0x18D08}, {0x1AFF0, 0x1AFF3}, {0x1AFF5, 0x1AFFB}, {0x1AFFD, 0x1AFFE}, {0x1B000, 0x1B122},
    {0x1B132, 0x1B132}, {0x1B150, 0x1B152}, {0x1B155, 0x1B155}, {0x1B164, 0x1B167}, {0x1B170, 0x1B2FB},
    {0x1BC00, 0x1BC6A}, {0x1BC70, 0x1BC7C}, {0x1BC80, 0x1BC88}, {0x1BC90, 0x1BC99}, {0x1D400, 0x1D454},
    {0x1D456, 0x1D49C}, {0x1D49E, 0x1D49F}, {0x1D4A2, 0x1D4A2}, {0x1D4A5, 0x1D4A6}, {0x1D4A9, 0x1D4AC},
    {0x1D4AE, 0x1D4B9}, {0x1D4BB, 0x1D4BB}, {0x1D4BD, 0x1D4C3}, {0x1D4C5, 0x1D505}, {0x1D507, 0x1D50A},
    {0x1D50D, 0x1D514}, {0x1D516, 0x1D51C}, {0x1D51E, 0x1D539}, {0x1D53B, 0x1D53E}, {0x1D540, 0x1D544},
    {0x1D546, 0x1D546}, {0x1D54A, 0x1D550}, {0x1D552, 0x1D6A5}, {0x1D6A8, 0x1D6C0}, {0x1D6C2, 0x1D6DA},
    {0x1D6DC, 0x1D6FA}, {0x1D6FC, 0x1D714}, {0x1D716, 0x1D734}, {0x1D736, 0x1D74E}, {0x1D750, 0x1D76E},
    {0x1D770, 0x1D788}, {0x1D78A, 0x1D7A8}, {0x1D7AA, 0x1D7C2}, {0x1D7C4, 0x1D7CB}, {0x1DF00, 0x1DF1E},
    {0x1DF25, 0x1DF2A}, {0x1E030, 0x1E06D}, {0x1E100, 0x1E12C}, {0x1E137, 0x1E13D}, {0x1E14E, 0x1E14E},
    {0x1E290, 0x1E2AD}, {0x1E2C0, 0x1E2EB}, {0x1E4D0, 0x1E4EB}, {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0},
    {0x1E7E0, 0x1E7E6}, {0x1E7E8, 0x1E7EB}, {0x1E7ED, 0x1E7EE}, {0x1E7F0, 0x1E7FE}, {0x1E800, 0x1E8C4},
    {0x1E900, 0x1E943}, {0x1E94B, 0x1E94B}, {0x1EE00, 0x1EE03}, {0x1EE05, 0x1EE1F}, {0x1EE21, 0x1EE22},
    {0x1EE24, 0x1EE24}, {0x1EE27, 0x1EE27}, {0x1EE29, 0x1EE32}, {0x1EE34, 0x1EE37}, {0x1EE39, 0x1EE39},
    {0x1EE3B, 0x1EE3B}, {0x1EE42, 0x1EE42}, {0x1EE47, 0x1EE47}, {0x1EE49, 0x1EE49}, {0x1EE4B, 0x1EE4B},
    {0x1EE4D, 0x1EE4F}, {0x1EE51, 0x1EE52}, {0x1EE54, 0x1EE54}, {0x1EE57, 0x1EE57}, {0x1EE59, 0x1EE59},
    {0x1EE5B, 0x1EE5B}, {0x1EE5D, 0x1EE5D}, {0x1EE5F, 0x1EE5F}, {0x1EE61, 0x1EE62}, {0x1EE64, 0x1EE64},
    {0x1EE67, 0x1EE6A}, {0x1EE6C, 0x1EE72}, {0x1EE74, 0x1EE77}, {0x1EE79, 0x1EE7C}, {0x1EE7E, 0x1EE7E},
    {0x1EE80, 0x1EE89}, {0x1EE8B, 0x1EE9B}, {0x1EEA1, 0x1EEA3}, {0x1EEA5, 0x1EEA9}, {0x1EEAB, 0x1EEBB},
    {0x20000, 0x2A6DF}, {0x2A700, 0x2B739}, {0x2B740, 0x2B81D}, {0x2B820, 0x2CEA1}, {0x2CEB0, 0x2EBE0},
    {0x2EBF0, 0x2EE5D}, {0x2F800, 0x2FA1D}, {0x30000, 0x3134A}, {0x31350, 0x323AF}
};
constexpr CodeRange kNumbers[] = {
    {0x30, 0x39}, {0xB2, 0xB3}, {0xB9, 0xB9}, {0xBC, 0xBE}, {0x660, 0x669}, {0x6F0, 0x6F9}, {0x7C0, 0x7C9},
    {0x966, 0x96F}, {0x9E6, 0x9EF}, {0x9F4, 0x9F9}, {0xA66, 0xA6F}, {0xAE6, 0xAEF}, {0xB66, 0xB6F}, {0xB72, 0xB77},
    {0xBE6, 0xBF2}, {0xC66, 0xC6F}, {0xC78, 0xC7E}, {0xCE6, 0xCEF}, {0xD58, 0xD5E}, {0xD66, 0xD78}, {0xDE6, 0xDEF},
    {0xE50, 0xE59}, {0xED0, 0xED9}, {0xF20, 0xF33}, {0x1040, 0x1049}, {0x1090, 0x1099}, {0x1369, 0x137C},
    {0x16EE, 0x16F0}, {0x17E0, 0x17E9}, {0x17F0, 0x17F9}, {0x1810, 0x1819}, {0x1946, 0x194F}, {0x19D0, 0x19DA},
    {0x1A80, 0x1A89}, {0x1A90, 0x1A99}, {0x1B50, 0x1B59}, {0x1BB0, 0x1BB9}, {0x1C40, 0x1C49}, {0x1C50, 0x1C59},
    {0x2070, 0x2070}, {0x2074, 0x2079}, {0x2080, 0x2089}, {0x2150, 0x2182}, {0x2185, 0x2189}, {0x2460, 0x249B},
    {0x24EA, 0x24FF}, {0x2776, 0x2793}, {0x2CFD, 0x2CFD}, {0x3007, 0x3007}, {0x3021, 0x3029}, {0x3038, 0x303A},
    {0x3192, 0x3195}, {0x3220, 0x3229}, {0x3248, 0x324F}, {0x3251, 0x325F}, {0x3280, 0x3289}, {0x32B1, 0x32BF},
    {0xA620, 0xA629}, {0xA6E6, 0xA6EF}, {0xA830, 0xA835}, {0xA8D0, 0xA8D9}, {0xA900, 0xA909}, {0xA9D0, 0xA9D9},
    {0xA9F0, 0xA9F9}, {0xAA50, 0xAA59}, {0xABF0, 0xABF9}, {0xFF10, 0xFF19}, {0x10107, 0x10133}, {0x10140, 0x10178},
    {0x1018A, 0x1018B}, {0x102E1, 0x102FB}, {0x10320, 0x10323}, {0x10341, 0x10341}, {0x1034A, 0x1034A},
    {0x103D1, 0x103D5}, {0x104A0, 0x104A9}, {0x10858, 0x1085F}, {0x10879, 0x1087F}, {0x108A7, 0x108AF},
    {0x108FB, 0x108FF}, {0x10916, 0x1091B}, {0x109BC, 0x109BD}, {0x109C0, 0x109CF}, {0x109D2, 0x109FF},
    {0x10A40, 0x10A48}, {0x10A7D, 0x10A7E}, {0x10A9D, 0x10A9F}, {0x10AEB, 0x10AEF}, {0x10B58, 0x10B5F},
    {0x10B78, 0x10B7F}, {0x10BA9, 0x10BAF}, {0x10CFA, 0x10CFF}, {0x10D30, 0x10D39}, {0x10D40, 0x10D49},
    {0x10E60, 0x10E7E}, {0x10F1D, 0x10F26}, {0x10F51, 0x10F54}, {0x10FC5, 0x10FCB}, {0x11052, 0x1106F},
    {0x110F0, 0x110F9}, {0x11136, 0x1113F}, {0x111D0, 0x111D9}, {0x111E1, 0x111F4}, {0x112F0, 0x112F9},
    {0x11450, 0x11459}, {0x114D0, 0x114D9}, {0x11650, 0x11659}, {0x116C0, 0x116C9}, {0x116D0, 0x116E3},
    {0x11730, 0x1173B}, {0x118E0, 0x118F2}, {0x11950, 0x11959}, {0x11BF0, 0x11BF9}, {0x11C50, 0x11C6C},
    {0x11D50, 0x11D59}, {0x11DA0, 0x11DA9}, {0x11F50, 0x11F59}, {0x11FC0, 0x11FD4}, {0x12400, 0x1246E},
    {0x16130, 0x16139}, {0x16A60, 0x16A69}, {0x16AC0, 0x16AC9}, {0x16B50, 0x16B59}, {0x16B5B, 0x16B61},
    {0x16D70, 0x16D79}, {0x16E80, 0x16E96}, {0x1CCF0, 0x1CCF9}, {0x1D2C0, 0x1D2D3}, {0x1D2E0, 0x1D2F3},
    {0x1D360, 0x1D378}, {0x1D7CE, 0x1D7FF}, {0x1E140, 0x1E149}, {0x1E2F0, 0x1E2F9}, {0x1E4F0, 0x1E4F9},
    {0x1E5F1, 0x1E5FA}, {0x1E8C7, 0x1E8CF}, {0x1E950, 0x1E959}, {0x1EC71, 0x1ECAB}, {0x1ECAD, 0x1ECAF},
    {0x1ECB1, 0x1ECB4}, {0x1ED01, 0x1ED2D}, {0x1ED2F, 0x1ED3D}, {0x1F100, 0x1F10C}, {0x1FBF0, 0x1FBF9}
};

bool is_letter(char32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return cp != kInvalid && in_ranges(cp, kLetters);
}
bool is_number(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return cp != kInvalid && in_ranges(cp, kNumbers);
}
// Unicode White_Space, which is both Oniguruma's and Rust regex's \s.
bool is_space(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}
// Rust regex's \w, approximated as letters, numbers and '_' (no marks or joiners): used only by
// added tokens with single_word.
bool is_word(char32_t cp) { return cp == '_' || is_letter(cp) || is_number(cp); }

enum class Class { letter, number, space, other };
Class classify(char32_t cp) {
  if (is_letter(cp)) return Class::letter;
  if (is_number(cp)) return Class::number;
  if (is_space(cp)) return Class::space;
  return Class::other;
}

// ---- Byte-level: GPT-2's bytes_to_unicode (Radford et al. 2019, encoder.py).

struct ByteAlphabet {
  std::array<std::string, 256> to_char;  // UTF-8 of the character standing for each byte
  std::unordered_map<char32_t, unsigned char> to_byte;
};

const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet alphabet = [] {
    ByteAlphabet a;
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp = printable ? static_cast<char32_t>(b) : next++;
      append_utf8(a.to_char[static_cast<std::size_t>(b)], cp);
      a.to_byte[cp] = static_cast<unsigned char>(b);
    }
    return a;
  }();
  return alphabet;
}

// The length of GPT-2's pre-tokenization pattern's match at s[i], as Oniguruma finds it:
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// Every character is matched by one alternative, so matches tile the text.
std::size_t gpt2_match(std::string_view s, std::size_t i) {
  if (s[i] == '\'') {
    for (std::string_view suffix : {"s", "t", "re", "ve", "m", "ll", "d"}) {
      if (s.substr(i + 1).starts_with(suffix)) return 1 + suffix.size();
    }
  }
  std::size_t j = i;
  if (s[j] == ' ' && j + 1 < s.size() && classify(next_char(s, j + 1).cp) != Class::space) ++j;
  const Char first = next_char(s, j);
  const Class cls = classify(first.cp);
  if (cls != Class::space) {
    std::size_t k = j + first.size;
    while (k < s.size()) {
      const Char c = next_char(s, k);
      if (classify(c.cp) != cls) break;
      k += c.size;
    }
    return k - i;
  }
  // A run of spaces: all of it at the end of the text, else all but its last character (which
  // then starts the next word as " word"), else the one character.
  std::size_t k = i, last = i;
  while (k < s.size()) {
    const Char c = next_char(s, k);
    if (!is_space(c.cp)) break;
    last = k;
    k += c.size;
  }
  if (k == s.size() || last == i) return k - i;
  return last - i;
}

// ---- The BPE model (Sennrich et al. 2016), as `tokenizers`' models/bpe.

std::uint64_t pair_key(std::int64_t a, std::int64_t b) {
  return (static_cast<std::uint64_t>(a) << 32) | static_cast<std::uint32_t>(b);
}

struct Bpe {
  std::unordered_map<std::string, std::int64_t> vocab;
  std::unordered_map<std::int64_t, std::string> vocab_r;
  std::unordered_map<std::uint64_t, std::pair<std::uint32_t, std::int64_t>> merges;  // (a, b) -> (rank, merged)
  std::optional<std::int64_t> unk;
  bool fuse_unk = false, byte_fallback = false, ignore_merges = false;
  std::string prefix, suffix;  // continuing_subword_prefix, end_of_word_suffix

  void tokenize(std::string_view word, std::vector<std::int64_t>& out) const;
};

void Bpe::tokenize(std::string_view word, std::vector<std::int64_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    if (auto it = vocab.find(std::string(word)); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    std::int64_t id;
    std::ptrdiff_t prev, next;
    bool gone;
  };
  std::vector<Symbol> symbols;
  auto add = [&](std::int64_t id) {
    const auto n = static_cast<std::ptrdiff_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, false});
  };
  std::int64_t pending_unk = -1;  // an unknown run not yet added (ids are never negative)
  std::string piece;
  for (std::size_t i = 0; i < word.size();) {
    const std::size_t end = i + next_char(word, i).size;
    piece.assign(word.substr(i, end - i));
    if (i > 0 && !prefix.empty()) piece.insert(0, prefix);
    if (end == word.size()) piece += suffix;
    if (auto it = vocab.find(piece); it != vocab.end()) {
      if (pending_unk >= 0) add(pending_unk), pending_unk = -1;
      add(it->second);
    } else {
      std::vector<std::int64_t> bytes;
      if (byte_fallback) {
        for (unsigned char b : piece) {
          char name[8];
          std::snprintf(name, sizeof name, "<0x%02X>", b);
          auto found = vocab.find(name);
          if (found == vocab.end()) break;
          bytes.push_back(found->second);
        }
      }
      if (byte_fallback && bytes.size() == piece.size()) {
        for (std::int64_t id : bytes) add(id);  // `tokenizers` leaves a pending unk for later here
      } else if (unk) {
        if (pending_unk >= 0 && !fuse_unk) add(pending_unk);
        pending_unk = *unk;
      }
    }
    i = end;
  }
  if (pending_unk >= 0) add(pending_unk);

  // Merge the lowest-ranked pair first, the leftmost among equals; stale entries are skipped
  // when popped, as `tokenizers`' Word::merge_all does.
  struct Merge {
    std::ptrdiff_t pos;
    std::uint32_t rank;
    std::int64_t id;
    bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Merge> queue;
  auto push = [&](std::ptrdiff_t pos, std::ptrdiff_t next) {
    auto it = merges.find(pair_key(symbols[static_cast<std::size_t>(pos)].id, symbols[static_cast<std::size_t>(next)].id));
    if (it != merges.end()) queue.push({pos, it->second.first, it->second.second});
  };
  for (std::size_t k = 0; k + 1 < symbols.size(); ++k) push(static_cast<std::ptrdiff_t>(k), static_cast<std::ptrdiff_t>(k + 1));
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = symbols[static_cast<std::size_t>(top.pos)];
    if (cur.gone || cur.next == -1) continue;
    const std::ptrdiff_t right_pos = cur.next;
    const Symbol right = symbols[static_cast<std::size_t>(right_pos)];
    auto it = merges.find(pair_key(cur.id, right.id));
    if (it == merges.end() || it->second.second != top.id) continue;
    cur.id = top.id;
    cur.next = right.next;
    symbols[static_cast<std::size_t>(right_pos)].gone = true;
    if (right.next >= 0) symbols[static_cast<std::size_t>(right.next)].prev = top.pos;
    if (cur.prev >= 0) push(cur.prev, top.pos);
    if (cur.next >= 0) push(top.pos, cur.next);
  }
  for (const Symbol& s : symbols) {
    if (!s.gone) out.push_back(s.id);
  }
}

// ---- Added tokens, as `tokenizers`' AddedVocabulary.

struct AddedToken {
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
  bool operator==(const AddedToken&) const = default;
};

// Leftmost-longest matching of a few patterns (what `tokenizers` builds an Aho-Corasick
// automaton for): the patterns are bucketed by first byte, longest first.
class Patterns {
 public:
  void add(std::string content, std::int64_t id) { all_.push_back({std::move(content), id}); }
  void finish() {
    for (std::size_t k = 0; k < all_.size(); ++k) by_first_[static_cast<unsigned char>(all_[k].first[0])].push_back(k);
    for (auto& bucket : by_first_) {
      std::stable_sort(bucket.begin(), bucket.end(), [&](std::size_t a, std::size_t b) { return all_[a].first.size() > all_[b].first.size(); });
    }
  }
  bool empty() const { return all_.empty(); }
  struct Match {
    std::size_t start, stop;
    std::int64_t id;
  };
  std::optional<Match> find(std::string_view s, std::size_t from) const {
    for (std::size_t start = from; start < s.size(); ++start) {
      for (std::size_t k : by_first_[static_cast<unsigned char>(s[start])]) {
        if (s.substr(start).starts_with(all_[k].first)) return Match{start, start + all_[k].first.size(), all_[k].second};
      }
    }
    return std::nullopt;
  }

 private:
  std::vector<std::pair<std::string, std::int64_t>> all_;
  std::array<std::vector<std::size_t>, 256> by_first_;
};

struct Segment {
  std::string_view text;
  std::optional<std::int64_t> id;  // set when the segment is an added token
};

// ---- Post-processing: templates for a single sequence, as TemplateProcessing's "single".

struct Template {
  struct Item {
    bool sequence = false;          // the encoded text, else `ids`
    std::vector<std::int64_t> ids;  // a special token's ids
  };
  std::vector<Item> items;
};

[[noreturn]] void fail(const std::string& path, const std::string& why, const std::string& todo) {
  throw std::runtime_error("cannot load tokenizer '" + path + "': " + why + ". " + todo);
}

std::string read_file(const fs::path& path, const std::string& shown) {
  try {
    return read_file_bytes(path);
  } catch (const std::runtime_error& e) {
    fail(shown, e.what(), "Check the path and its permissions.");
  }
}

// `format`: "tokenizer.json" or "tokenizer_config.json", for the advice.
json parse_json(const std::string& text, const std::string& shown, const std::string& format) {
  try {
    check_json_nesting(text);
  } catch (const std::exception& e) {
    fail(shown, e.what(), "It is not a Hugging Face " + format + ": pass the one the model came with.");
  }
  try {
    return json::parse(text);
  } catch (const std::exception& e) {
    fail(shown, std::string("not valid JSON (") + e.what() + ")", "The file may be truncated: download it again (Hugging Face " + format + " format).");
  }
}

// A component's "type" ("BPE", "ByteLevel"); a type that is there must be a string.
std::string type_of(const JsonAt& j) { return j.is_object() ? j.str_or("type", "(no type)") : "(not an object)"; }

// An optional member: absent and null are the same (Hugging Face writes null for "none").
JsonAt member_or_null(const JsonAt& j, const std::string& key) {
  const auto v = j.find(key);
  return v ? *v : JsonAt();
}

}  // namespace

struct HuggingFaceTokenizer::Impl {
  std::string path;
  Bpe bpe;
  std::unordered_map<std::string, std::int64_t> added_ids;      // content -> id
  std::unordered_map<std::int64_t, AddedToken> added_by_id;     // id -> token
  std::unordered_set<std::string> special;                      // contents of special tokens
  Patterns raw_patterns, normalized_patterns;
  bool byte_level = false, add_prefix_space = false, use_regex = true;
  std::vector<Template> post;
  bool byte_level_decoder = false;
  std::int64_t vocab_size = 0;
  std::optional<std::int64_t> bos, eos;

  std::optional<std::int64_t> token_to_id(std::string_view token) const {
    const std::string key(token);
    if (auto it = added_ids.find(key); it != added_ids.end()) return it->second;
    if (auto it = bpe.vocab.find(key); it != bpe.vocab.end()) return it->second;
    return std::nullopt;
  }

  // Every value read through JsonAt: one of the wrong type is refused naming its JSON pointer.
  void load(const JsonAt& root);
  void load_model(const JsonAt& model);
  void load_added(const JsonAt& tokens);
  void load_pre_tokenizer(const JsonAt& pre);
  void load_post_processor(const JsonAt& post);
  void load_config(const fs::path& config);

  void split_added(std::string_view text, const Patterns& patterns, std::vector<Segment>& out) const;
  void encode_text(std::string_view text, std::vector<std::int64_t>& out,
                   std::unordered_map<std::string, std::vector<std::int64_t>>& cache) const;
};

void HuggingFaceTokenizer::Impl::load(const JsonAt& root) {
  if (!root.is_object()) fail(path, "the top level is not a JSON object", "Pass a Hugging Face tokenizer.json.");
  if (!root.has("model")) fail(path, "it has no \"model\"", "Pass a Hugging Face tokenizer.json.");
  load_model(root["model"]);
  const JsonAt normalizer = member_or_null(root, "normalizer");
  if (!normalizer.is_null() && !(type_of(normalizer) == "Sequence" && member_or_null(normalizer, "normalizers").size() == 0)) {
    fail(path, "normalizer type \"" + type_of(normalizer) + "\" is not supported (spmdx supports none)",
         "Use a byte-level BPE tokenizer without a normalizer (GPT-2 style), or the \"byte\" tokenizer.");
  }
  load_pre_tokenizer(member_or_null(root, "pre_tokenizer"));
  load_added(member_or_null(root, "added_tokens"));
  load_post_processor(member_or_null(root, "post_processor"));
  const JsonAt decoder = member_or_null(root, "decoder");
  if (!decoder.is_null() && type_of(decoder) != "ByteLevel") {
    fail(path, "decoder type \"" + type_of(decoder) + "\" is not supported (spmdx supports ByteLevel or none)",
         "Use a byte-level BPE tokenizer, or the \"byte\" tokenizer.");
  }
  byte_level_decoder = !decoder.is_null();
  for (const auto& [token, id] : bpe.vocab) vocab_size = std::max(vocab_size, id + 1);
  for (const auto& [token, id] : added_ids) vocab_size = std::max(vocab_size, id + 1);
  if (vocab_size <= 0) fail(path, "its vocabulary is empty", "Pass a tokenizer.json with a model.vocab.");
  if (vocab_size > (std::int64_t{1} << 24)) fail(path, "an added token has an id of " + std::to_string(vocab_size - 1), "Fix its added_tokens ids.");
  // The vocabulary is the largest id + 1 (the embedding and the output need a row for every id
  // the tokenizer can give), so one id far past the others (16777215 typed for 167) makes
  // millions of rows no token uses: 16 GiB a matrix for Llama's dim. Warned, not refused: a
  // tokenizer may reserve a range of ids on purpose, and the job's memory check refuses a
  // model that cannot fit (naming this vocabulary); the warning says where the size comes from.
  std::int64_t defined = static_cast<std::int64_t>(bpe.vocab_r.size());
  for (const auto& [id, token] : added_by_id) defined += bpe.vocab_r.count(id) ? 0 : 1;
  if (const std::int64_t unused = vocab_size - defined; unused > defined && unused > 4096) {
    const std::int64_t largest = vocab_size - 1;
    auto it = added_by_id.find(largest);
    const std::string token = it != added_by_id.end() ? it->second.content : bpe.vocab_r.count(largest) ? bpe.vocab_r.at(largest) : "?";
    SPMDX_WARN("tokenizer '" << path << "': its largest id, " << largest << " (\"" << token << "\"), makes a vocabulary of " << vocab_size << " ids for the "
                             << defined << " tokens it defines: the " << unused << " ids no token has still get a row each in the embedding and the output; "
                             << "if that id is a mistake, renumber the file's ids from 0 without gaps");
  }
}

void HuggingFaceTokenizer::Impl::load_model(const JsonAt& model) {
  const std::string type = model.is_object() && !model.has("type") && model.has("merges") ? "BPE" : type_of(model);
  if (type != "BPE") {
    fail(path, "model type \"" + type + "\" is not supported (spmdx supports BPE)",
         "Use a BPE tokenizer.json (GPT-2, Llama 3 and torchtitan's test tokenizer are BPE), or the \"byte\" tokenizer.");
  }
  if (model.number_or("dropout", 0.0) > 0.0) {
    fail(path, "BPE dropout is set, which samples a different tokenization on every call",
         "Set \"dropout\" to null in the file for deterministic training data.");
  }
  if (!model.has("vocab") || !model["vocab"].is_object()) {
    fail(path, "its model.vocab is not a JSON object", "Pass a Hugging Face tokenizer.json.");
  }
  for (const auto& [token, id] : model["vocab"].raw().items()) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 || id.get<std::int64_t>() >= (std::int64_t{1} << 24)) {
      fail(path, "model.vocab maps \"" + token + "\" to " + id.dump() + ", not an id in [0, 16777216)",
           "Fix the vocab; ids are small non-negative integers.");
    }
    if (auto [other, fresh] = bpe.vocab_r.emplace(id.get<std::int64_t>(), token); !fresh) {
      const auto& [first, second] = std::minmax(other->second, token);  // in text order, whatever the JSON library's
      fail(path, "model.vocab maps both \"" + first + "\" and \"" + second + "\" to " + id.dump() + ": the two would train as one token",
           "Fix the vocab; each id belongs to one token.");
    }
    bpe.vocab[token] = id.get<std::int64_t>();
  }
  bpe.prefix = model.str_or("continuing_subword_prefix", "");
  bpe.suffix = model.str_or("end_of_word_suffix", "");
  bpe.fuse_unk = model.bool_or("fuse_unk", false);
  bpe.byte_fallback = model.bool_or("byte_fallback", false);
  bpe.ignore_merges = model.bool_or("ignore_merges", false);
  if (const std::string unk = model.str_or("unk_token", ""); !unk.empty()) {
    auto it = bpe.vocab.find(unk);
    if (it == bpe.vocab.end()) fail(path, "its unk_token \"" + unk + "\" is not in the vocabulary", "Fix the file's model.unk_token.");
    bpe.unk = it->second;
  }
  const JsonAt merges = member_or_null(model, "merges");
  if (!merges.is_null()) merges.array();
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const JsonAt m = merges.at(rank);
    std::string a, b;
    if (m.is_string()) {  // "a b", the older form
      const std::string& line = m.str();
      const std::size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        fail(path, "merge " + std::to_string(rank + 1) + " \"" + line + "\" is not two tokens separated by one space",
             "Fix or regenerate the file's model.merges.");
      }
      a = line.substr(0, space), b = line.substr(space + 1);
    } else {
      if (!m.is_array() || m.size() != 2) m.wrong("a merge (\"a b\" or [\"a\", \"b\"])");
      a = m.at(0).str(), b = m.at(1).str();
    }
    auto id = [&](const std::string& token) {
      auto it = bpe.vocab.find(token);
      if (it == bpe.vocab.end()) {
        fail(path, "merge " + std::to_string(rank + 1) + " uses \"" + token + "\", which is not in the vocabulary",
             "Fix or regenerate the file's model.merges.");
      }
      return it->second;
    };
    if (b.size() < bpe.prefix.size()) fail(path, "merge " + std::to_string(rank + 1) + " is shorter than the subword prefix", "Fix the file's model.merges.");
    const std::int64_t left = id(a), right = id(b), merged = id(a + b.substr(bpe.prefix.size()));
    bpe.merges[pair_key(left, right)] = {static_cast<std::uint32_t>(rank), merged};
  }
}

// Ids as `tokenizers` gives them when it reads the file (it ignores the ids written there): a
// token already known keeps its id, a new one gets the next id after the model's vocabulary.
// The file's ids must be ids (tokenizers' loader refuses others: its ids are u32); one that
// differs from the id given is warned of, as tokenizers does: a checkpoint trained with the
// file's ids would read other rows of the embedding.
void HuggingFaceTokenizer::Impl::load_added(const JsonAt& tokens) {
  std::vector<AddedToken> special_list, plain_list;
  const auto model_size = static_cast<std::int64_t>(bpe.vocab.size());
  std::int64_t moved = 0;
  std::string first_moved;
  if (!tokens.is_null()) tokens.array();
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const JsonAt t = tokens.at(i).object();
    const json written = t.has("id") ? t["id"].raw() : json();
    if (t.has("id") &&
        !(written.is_number_integer() && (written.is_number_unsigned() ? written.get<std::uint64_t>() <= 0xFFFFFFFFull : written.get<std::int64_t>() >= 0))) {
      std::string shown = written.dump();
      if (shown.size() > 40) shown = shown.substr(0, 37) + "...";
      fail(path, "added_tokens[" + std::to_string(i) + "] has the id " + shown + ", not an id from 0 to 2^32 - 1",
           "Fix the file's added_tokens (Hugging Face tokenizers refuses it too).");
    }
    AddedToken token{t["content"].str(), t.bool_or("single_word", false), t.bool_or("lstrip", false),
                     t.bool_or("rstrip", false), t.bool_or("normalized", true), t.bool_or("special", false)};
    if (token.special && !token.content.empty() && special.insert(token.content).second) special_list.push_back(token);
    if (token.content.empty() ||
        std::any_of(added_by_id.begin(), added_by_id.end(), [&](const auto& entry) { return entry.second == token; })) {
      continue;
    }
    std::int64_t id = model_size;
    if (auto known = token_to_id(token.content)) {
      id = *known;
    } else if (!added_ids.empty()) {
      std::int64_t max = 0;
      for (const auto& [content, added] : added_ids) max = std::max(max, added);
      id = max >= model_size || model_size == 0 ? max + 1 : model_size;
    }
    if (auto taken = bpe.vocab_r.find(id); taken != bpe.vocab_r.end() && taken->second != token.content) {
      fail(path, "added token \"" + token.content + "\" gets id " + std::to_string(id) + " (Hugging Face tokenizers numbers new added tokens from model.vocab's count of entries, " +
                     std::to_string(model_size) + "), which model.vocab gives \"" +
                     taken->second + "\": the vocab's ids have gaps",
           "Number model.vocab's ids 0 .. N-1, or put the token in model.vocab with the id it should have.");
    }
    if (written.is_number_integer() && written.get<std::int64_t>() != id && ++moved == 1) {
      first_moved = "\"" + token.content + "\" gets " + std::to_string(id) + ", the file says " + written.dump();
    }
    added_ids[token.content] = id;
    added_by_id[id] = token;
    if (!special.contains(token.content)) plain_list.push_back(token);
  }
  for (const auto* list : {&special_list, &plain_list}) {
    for (const AddedToken& token : *list) {
      (token.normalized ? normalized_patterns : raw_patterns).add(token.content, *token_to_id(token.content));
    }
  }
  raw_patterns.finish();
  normalized_patterns.finish();
  if (moved > 0) {
    SPMDX_WARN("tokenizer '" << path << "': " << moved << " added token" << (moved == 1 ? "" : "s") << " get" << (moved == 1 ? "s" : "")
                             << " another id than the file's (" << first_moved << "), numbered as Hugging Face tokenizers numbers them; "
                             << "a checkpoint trained with the file's ids reads other embedding rows for them");
  }
}

void HuggingFaceTokenizer::Impl::load_pre_tokenizer(const JsonAt& pre) {
  const std::string todo =
      "Use a tokenizer.json whose pre_tokenizer is ByteLevel (GPT-2 style), or the \"byte\" tokenizer.";
  if (pre.is_null()) return;
  JsonAt level = pre;
  if (type_of(pre) == "Sequence") {
    const JsonAt list = member_or_null(pre, "pretokenizers");
    if (!list.is_null()) list.array();
    if (list.size() == 0) return;
    if (list.size() != 1) fail(path, "a Sequence of " + std::to_string(list.size()) + " pre-tokenizers is not supported (spmdx supports one ByteLevel)", todo);
    level = list.at(0);
  }
  if (type_of(level) != "ByteLevel") {
    fail(path, "pre-tokenizer type \"" + type_of(level) + "\" is not supported (spmdx supports ByteLevel)", todo);
  }
  byte_level = true;
  add_prefix_space = level.bool_or("add_prefix_space", true);
  use_regex = level.bool_or("use_regex", true);
}

void HuggingFaceTokenizer::Impl::load_post_processor(const JsonAt& pp) {
  if (pp.is_null()) return;
  const std::string type = type_of(pp);
  const std::string todo = "Set \"post_processor\" to null in a copy of the file and add BOS/EOS yourself.";
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const JsonAt processors = member_or_null(pp, "processors");
    if (!processors.is_null()) processors.array();
    for (std::size_t i = 0; i < processors.size(); ++i) load_post_processor(processors.at(i));
  } else if (type == "TemplateProcessing") {
    Template t;
    for (const JsonAt& item : pp["single"].elements()) {
      if (item.object().has("Sequence")) {
        if (item["Sequence"].str_or("id", "A") != "A") fail(path, "its single template uses sequence B", todo);
        t.items.push_back({true, {}});
      } else {
        const std::string& name = item["SpecialToken"]["id"].str();
        const auto specials = pp.find("special_tokens");
        if (!specials || !specials->object().has(name)) fail(path, "its template names special token \"" + name + "\", which it does not define", todo);
        std::vector<std::int64_t> ids;
        for (const JsonAt& id : (*specials)[name]["ids"].elements()) ids.push_back(id.whole());
        t.items.push_back({false, std::move(ids)});
      }
    }
    post.push_back(std::move(t));
  } else if (type == "BertProcessing" || type == "RobertaProcessing") {
    post.push_back(Template{{{false, {pp["cls"].at(1).whole()}},
                             {true, {}},
                             {false, {pp["sep"].at(1).whole()}}}});
  } else {
    fail(path, "post-processor type \"" + type + "\" is not supported (spmdx supports TemplateProcessing, ByteLevel, "
               "BertProcessing, RobertaProcessing)", todo);
  }
}

void HuggingFaceTokenizer::Impl::load_config(const fs::path& config) {
  std::error_code ec;
  if (!fs::exists(config, ec)) return;
  const std::string shown = config.string();
  const json parsed = parse_json(read_file(config, shown), shown, "tokenizer_config.json");
  const JsonAt root(parsed);
  auto special_id = [&](const char* key) -> std::optional<std::int64_t> {
    if (!root.is_object()) return std::nullopt;
    JsonAt value = member_or_null(root, key);
    if (value.is_object()) value = member_or_null(value, "content");  // an AddedToken: {"content": "<s>", ...}
    if (value.is_null()) return std::nullopt;
    if (!value.is_string()) fail(shown, value.where() + " is " + value.shown() + ", not a string", "Fix the file.");
    const std::string token = value.str();
    auto id = token_to_id(token);
    if (!id) {
      fail(shown, std::string("its ") + key + " \"" + token + "\" is not a token of '" + path + "'",
           "Fix the file, or remove it to have no BOS/EOS.");
    }
    return id;
  };
  bos = special_id("bos_token");
  eos = special_id("eos_token");
}

// Cuts `text` at the added tokens in it, as AddedVocabulary::find_matches.
void HuggingFaceTokenizer::Impl::split_added(std::string_view text, const Patterns& patterns, std::vector<Segment>& out) const {
  if (patterns.empty()) {
    out.push_back({text, std::nullopt});
    return;
  }
  auto char_before = [&](std::size_t end) { return next_char(text, char_start_before(text, end)).cp; };
  std::size_t done = 0;
  for (std::size_t from = 0; auto match = patterns.find(text, from);) {
    from = match->stop;  // a match dropped below still consumes its text, as in `tokenizers`
    std::size_t start = match->start, stop = match->stop;
    const AddedToken& token = added_by_id.at(match->id);
    if (token.single_word) {
      const bool word_before = start > 0 && is_word(char_before(start));
      const bool word_after = stop < text.size() && is_word(next_char(text, stop).cp);
      if (word_before || word_after) continue;
    }
    if (token.lstrip) {
      std::size_t s = start;
      while (s > 0 && is_space(char_before(s))) s = char_start_before(text, s);
      start = std::max(s, done);
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        const Char c = next_char(text, stop);
        if (!is_space(c.cp)) break;
        stop += c.size;
      }
    }
    if (done < start) out.push_back({text.substr(done, start - done), std::nullopt});
    out.push_back({text.substr(start, stop - start), match->id});
    done = stop;
  }
  if (done < text.size()) out.push_back({text.substr(done), std::nullopt});
}

void HuggingFaceTokenizer::Impl::encode_text(std::string_view text, std::vector<std::int64_t>& out,
                                             std::unordered_map<std::string, std::vector<std::int64_t>>& cache) const {
  // Words repeat: remember the short ones' ids for this call.
  auto bpe_cached = [&](const std::string& word) {
    if (word.size() > 64) return bpe.tokenize(word, out);
    auto it = cache.find(word);
    if (it == cache.end()) {
      std::vector<std::int64_t> ids;
      bpe.tokenize(word, ids);
      it = cache.emplace(word, std::move(ids)).first;
    }
    out.insert(out.end(), it->second.begin(), it->second.end());
  };
  if (!byte_level) {
    bpe_cached(std::string(text));
    return;
  }
  std::string with_space;
  if (add_prefix_space && !text.starts_with(' ')) text = with_space = " " + std::string(text);
  const ByteAlphabet& alphabet = byte_alphabet();
  std::string word;
  for (std::size_t i = 0; i < text.size();) {
    const std::size_t n = use_regex ? gpt2_match(text, i) : text.size();
    word.clear();
    for (unsigned char b : text.substr(i, n)) word += alphabet.to_char[b];
    bpe_cached(word);
    i += n;
  }
}

HuggingFaceTokenizer::HuggingFaceTokenizer(const std::string& tokenizer_json) {
  auto impl = std::make_unique<Impl>();
  impl->path = tokenizer_json;
  std::error_code ec;
  if (!fs::exists(tokenizer_json, ec)) {
    fail(tokenizer_json, "the file does not exist",
         "Pass \"byte\", or the path of a Hugging Face tokenizer.json (or of a folder holding one).");
  }
  const json root = parse_json(read_file(tokenizer_json, tokenizer_json), tokenizer_json, "tokenizer.json");
  try {
    impl->load(JsonAt(root));
  } catch (const JsonError& e) {
    fail(tokenizer_json, e.what(), "The file does not follow the Hugging Face tokenizer.json format: fix that value, or regenerate the file with `tokenizers`.");
  }
  impl->load_config(fs::path(tokenizer_json).parent_path() / "tokenizer_config.json");
  impl_ = std::move(impl);
}

HuggingFaceTokenizer::~HuggingFaceTokenizer() = default;

std::vector<std::int64_t> HuggingFaceTokenizer::encode(std::string_view text) const {
  const Impl& m = *impl_;
  // Added tokens first (those matched before normalization, then the others), then each piece
  // between them is pre-tokenized and BPE-encoded on its own, as Tokenizer::encode.
  std::vector<Segment> raw, segments;
  m.split_added(text, m.raw_patterns, raw);
  for (const Segment& s : raw) {
    if (s.id) {
      segments.push_back(s);
    } else {
      m.split_added(s.text, m.normalized_patterns, segments);
    }
  }
  std::vector<std::int64_t> ids;
  std::unordered_map<std::string, std::vector<std::int64_t>> cache;
  for (const Segment& s : segments) {
    if (s.id) {
      ids.push_back(*s.id);
    } else if (!s.text.empty()) {
      m.encode_text(s.text, ids, cache);
    }
  }
  for (const Template& t : m.post) {
    std::vector<std::int64_t> with;
    for (const Template::Item& item : t.items) {
      const auto& part = item.sequence ? ids : item.ids;
      with.insert(with.end(), part.begin(), part.end());
    }
    ids = std::move(with);
  }
  return ids;
}

std::string HuggingFaceTokenizer::decode(std::span<const std::int64_t> ids) const {
  const Impl& m = *impl_;
  std::vector<const std::string*> tokens;
  for (std::int64_t id : ids) {
    const std::string* token = nullptr;
    if (auto it = m.added_by_id.find(id); it != m.added_by_id.end()) {
      token = &it->second.content;
    } else if (auto v = m.bpe.vocab_r.find(id); v != m.bpe.vocab_r.end()) {
      token = &v->second;
    }
    if (token && !m.special.contains(*token)) tokens.push_back(token);
  }
  std::string out;
  if (!m.byte_level_decoder) {
    for (std::size_t k = 0; k < tokens.size(); ++k) out += (k == 0 ? "" : " ") + *tokens[k];
    return out;
  }
  // Each token's characters back to bytes; a token with a character outside the byte
  // alphabet stays as it is, as `tokenizers`' ByteLevel decoder does.
  const ByteAlphabet& alphabet = byte_alphabet();
  for (const std::string* token : tokens) {
    std::string bytes;
    bool mapped = true;
    for (std::size_t i = 0; i < token->size() && mapped;) {
      const Char c = next_char(*token, i);
      auto it = alphabet.to_byte.find(c.cp);
      mapped = it != alphabet.to_byte.end();
      if (mapped) bytes += static_cast<char>(it->second);
      i += c.size;
    }
    out += mapped ? bytes : *token;
  }
  return utf8_lossy(out);
}

std::int64_t HuggingFaceTokenizer::vocab_size() const { return impl_->vocab_size; }
std::optional<std::int64_t> HuggingFaceTokenizer::bos_id() const { return impl_->bos; }
std::optional<std::int64_t> HuggingFaceTokenizer::eos_id() const { return impl_->eos; }
std::optional<std::int64_t> HuggingFaceTokenizer::token_to_id(std::string_view token) const {
  return impl_->token_to_id(token);
}

std::vector<std::int64_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<std::int64_t> ids;
  ids.reserve(text.size());
  for (unsigned char b : text) ids.push_back(b);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const std::int64_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (std::int64_t id : ids) {
    if (id >= 0 && id < 256) text += static_cast<char>(id);
  }
  return text;
}

std::vector<std::int64_t> encode_document(const Tokenizer& tokenizer, std::string_view text) {
  std::vector<std::int64_t> ids = tokenizer.encode(text);
  // What the tokenizer adds by itself shows in the ids of the empty text (torchtitan's test).
  const auto bos = tokenizer.bos_id(), eos = tokenizer.eos_id();
  if (!bos && !eos) return ids;
  const std::vector<std::int64_t> own = tokenizer.encode("");
  auto adds = [&](std::int64_t id) { return std::find(own.begin(), own.end(), id) != own.end(); };
  if (bos && !adds(*bos)) ids.insert(ids.begin(), *bos);
  if (eos && !adds(*eos)) ids.push_back(*eos);
  return ids;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  std::error_code ec;
  if (fs::is_directory(spec, ec)) return std::make_unique<HuggingFaceTokenizer>((fs::path(spec) / "tokenizer.json").string());
  return std::make_unique<HuggingFaceTokenizer>(spec);
}

}  // namespace spmdx::data
