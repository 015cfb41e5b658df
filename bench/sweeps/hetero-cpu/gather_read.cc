// Strided gather vs contiguous copy from cold memory, one thread (issue 29 item 4).
// g++ -O2 -o /tmp/gather_read bench/sweeps/hetero-cpu/gather_read.cc && /tmp/gather_read PIECE STRIDE MODE(0 memcpy,1 inline avx512) PREFETCH_BYTES STAGE_KIB
// e.g. /tmp/gather_read 512 1024 0 32768 256 (HP=1: MADV_HUGEPAGE on the source)
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <sys/mman.h>
#include <immintrin.h>
#include <ctime>
#include <algorithm>
static double cpu(){timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
__attribute__((target("avx512f"))) static inline void cp64(char* to,const char* f,size_t len){
  size_t i=0; for(;i+256<=len;i+=256){__m512i a=_mm512_loadu_si512(f+i),b=_mm512_loadu_si512(f+i+64),c=_mm512_loadu_si512(f+i+128),d=_mm512_loadu_si512(f+i+192);
   _mm512_storeu_si512(to+i,a);_mm512_storeu_si512(to+i+64,b);_mm512_storeu_si512(to+i+128,c);_mm512_storeu_si512(to+i+192,d);}
  for(;i+64<=len;i+=64)_mm512_storeu_si512(to+i,_mm512_loadu_si512(f+i));
  if(i<len)memcpy(to+i,f+i,len-i);}
int main(int argc,char**argv){
  size_t N=512ull<<20; char* src=(char*)mmap(0,N,PROT_READ|PROT_WRITE,MAP_PRIVATE|MAP_ANONYMOUS,-1,0);
  madvise(src,N,getenv("HP")?MADV_HUGEPAGE:MADV_NOHUGEPAGE); memset(src,1,N);
  size_t SB=atoi(argv[5])<<10; char* stage=(char*)aligned_alloc(4096,SB); memset(stage,0,SB);
  size_t piece=atoi(argv[1]), stride=atoi(argv[2]); int mode=atoi(argv[3]); size_t aheadB=atoi(argv[4]);
  size_t pieces=N/stride; size_t cap=SB/piece; volatile char sink=0; size_t ahead=aheadB/stride;
  double best=1e9;
  for(int rep=0;rep<4;rep++){
   double t0=cpu(); size_t moved=0;
   for(size_t i=0;i<pieces;){
     size_t k=std::min(cap,pieces-i);
     const char* base=src+i*stride;
     for(size_t j=0;j<k;j++){ const char* f=base+j*stride;
       if(ahead && j+ahead<k) __builtin_prefetch(f+ahead*stride,0);
       if(mode==0) memcpy(stage+j*piece,f,piece); else cp64(stage+j*piece,f,piece);}
     i+=k; moved+=k*piece; sink+=stage[1];
   }
   double t=cpu()-t0; best=std::min(best,t/(moved/1e9));
  }
  printf("piece %zu stride %zu mode %d ahead %zuB stage %zuK: best %.3f s/GB\n",piece,stride,mode,aheadB,SB>>10,best);
}
